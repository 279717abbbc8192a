"""The network and its files: what a model directory says (`config`), the transformer (`model`),
attention over dense K/V or a KV pool (`attention`, `kv`), where arrays live on a mesh
(`sharding`), reading and writing weights (`checkpoint`, `hf_checkpoint`, `files`) and the
tokenizer. Nothing here knows about decoding: the static path, the engine and the server all
build on it.
"""
