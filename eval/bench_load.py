"""Where an HF snapshot's load goes, at real size: `acache_jax.load` and the host-to-device transfer
variants it could use, on the snapshot's own tensors, in one process (GPU; run after
`eval.real_scale` wrote the snapshot).

    python -m eval.bench_load SNAPSHOT_DIR [read] [load] [hostcopy] [put] [populate] [pread] [resident]
                                           [pinned] [chunked]

Each line: seconds and GB/s over the snapshot's bytes. `read`: the files read from the page cache
in 16 MiB reads (the floor `load` is measured against). `load`: `acache_jax.load` twice as it is
(the first compiles, or reads from the cache, the relayout and fusion programs; the second has
them), then with more placing threads and a larger in-flight window, then with each tensor staged
through pinned host memory (monkeypatched here, to try them before changing the library); under
each, the time from the start of the load until `read_hf` handed out its last parameter (the read,
copies, relayouts and fusions) and what the load did after it (the finiteness check, the model
filled). `load` reads no tokenizer: that is loaded at its first use. The rest time one way of
moving every tensor to the device each: a host copy of the mapped tensor (`hostcopy`), `device_put`
of the mapped tensor on 1-8 threads (`put`), of a MAP_POPULATE map (`populate`), of a pread into
fresh memory (`pread`), of tensors already in anonymous memory (`resident`, also one batched call
and the pinned-host round trip), via pinned host memory (`pinned`), and in 64 MiB pieces
concatenated on the device (`chunked`).
"""
import mmap
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from acache_jax.network.config import ModelConfig
from acache_jax.network.hf_checkpoint import ST_DTYPES, ST_ITEMSIZE, checked_tensors, map_tensor

snap = Path(sys.argv[1])
only = set(sys.argv[2:])
cfg = ModelConfig.from_file(snap)
infos = [info for _, info in checked_tensors(snap, cfg)]
total = sum(i.nbytes for i in infos)
dev = jax.devices()[0]
print(f"{len(infos)} tensors, {total / 1e9:.2f} GB, largest {max(i.nbytes for i in infos) / 1e9:.2f} GB, {dev}", flush=True)
jax.device_put(np.zeros(1 << 20, np.float32), dev).block_until_ready()


def timed(name, fn):
    if only and name.split("/")[0] not in only:
        return
    t = time.perf_counter()
    out = fn()
    if out is not None:
        jax.block_until_ready(out)
    s = time.perf_counter() - t
    print(f"{name:40s} {s:6.2f} s  {total / s / 1e9:6.2f} GB/s", flush=True)
    del out


def pool_map(fn, items, threads):
    with ThreadPoolExecutor(threads) as ex:
        return list(ex.map(fn, items))


def read_buffered():
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    for f in sorted({i.file for i in infos}):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass


timed("read/16MiB", read_buffered)
timed("read/16MiB again", read_buffered)

PINNED = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
ON_DEVICE = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")

if not only or "load" in only:
    import acache_jax
    from acache_jax.network import checkpoint as ck
    read_hf, read_done = ck.read_hf, []

    def clocked_read(*a, **k):
        yield from read_hf(*a, **k)
        read_done.append(time.perf_counter())

    ck.read_hf = clocked_read

    def timed_load(label):
        t0 = time.perf_counter()
        m = acache_jax.load(snap)
        jax.block_until_ready(m.params)
        t1 = time.perf_counter()
        print(f"acache_jax.load {label}: {t1 - t0:.2f} s", flush=True)
        print(f"  read_hf: {read_done[-1] - t0:.2f} s, then the rest of load: {t1 - read_done[-1]:.2f} s", flush=True)
        del m

    timed_load("#0 (as is)")
    timed_load("#1 (as is)")
    ck.PLACE_THREADS, ck.IN_FLIGHT_BYTES = 8, 2 << 30
    timed_load("threads 8, 2 GiB in flight")

    def transfer_pinned(path, array, *a, **k):  # in place of sharding.transfer_param (no mesh here)
        return jax.device_put(jax.device_put(array, PINNED), ON_DEVICE)

    ck.transfer_param = transfer_pinned
    for threads in (4, 8):
        ck.PLACE_THREADS = threads
        try:
            timed_load(f"pinned staging, threads {threads}, 2 GiB in flight")
        except Exception as e:  # noqa: BLE001
            print("pinned load failed:", type(e).__name__, str(e)[:300], flush=True)


for t in (4, 8):
    timed(f"hostcopy/mmap threads={t}", lambda t=t: pool_map(lambda i: np.array(map_tensor(i)).nbytes, infos, t) and None)


def put_mmap(info):
    return jax.device_put(map_tensor(info), dev).block_until_ready()


for t in (1, 4, 8):
    timed(f"put/mmap threads={t}", lambda t=t: pool_map(put_mmap, infos, t))


def map_populate(info):
    start = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY
    with open(info.file, "rb") as f:
        region = mmap.mmap(f.fileno(), info.offset + info.nbytes - start, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                           prot=mmap.PROT_READ, offset=start)
    count = info.nbytes // ST_ITEMSIZE[info.dtype]
    return np.frombuffer(region, ST_DTYPES[info.dtype], count, info.offset - start).reshape(info.shape)


for t in (4, 8):
    timed(f"populate/put threads={t}", lambda t=t: pool_map(lambda i: jax.device_put(map_populate(i), dev).block_until_ready(), infos, t))


def pread(info):
    out = np.empty(info.shape, ST_DTYPES[info.dtype])
    with open(info.file, "rb", buffering=0) as f:
        f.seek(info.offset)
        f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
    return out


for t in (4, 8):
    timed(f"pread/put threads={t}", lambda t=t: pool_map(lambda i: jax.device_put(pread(i), dev).block_until_ready(), infos, t))

if not only or "resident" in only:
    t0 = time.perf_counter()
    resident = pool_map(pread, infos, 8)
    print(f"pre-read into anonymous memory: {time.perf_counter() - t0:.2f} s", flush=True)
    for t in (1, 4, 8):
        timed(f"resident/put threads={t}", lambda t=t: pool_map(lambda a: jax.device_put(a, dev).block_until_ready(), resident, t))
    timed("resident/put one call", lambda: jax.device_put(resident, dev))
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    try:
        t0 = time.perf_counter()
        staged = [jax.device_put(a, pinned).block_until_ready() for a in resident[:40]]
        s = time.perf_counter() - t0
        nb = sum(a.nbytes for a in resident[:40])
        print(f"to pinned_host (40 tensors): {s:.2f} s {nb / s / 1e9:.2f} GB/s", flush=True)
        t0 = time.perf_counter()
        on = [jax.device_put(a, jax.sharding.SingleDeviceSharding(dev, memory_kind="device")) for a in staged]
        jax.block_until_ready(on)
        s = time.perf_counter() - t0
        print(f"pinned_host -> device (40 tensors): {s:.2f} s {nb / s / 1e9:.2f} GB/s", flush=True)
        del staged, on
    except Exception as e:  # noqa: BLE001
        print("pinned_host failed:", type(e).__name__, e)
    del resident



def put_pinned(info):
    staged = jax.device_put(map_tensor(info), PINNED)
    return jax.device_put(staged, ON_DEVICE).block_until_ready()


for t in (1, 4, 8):
    try:
        timed(f"pinned/put threads={t}", lambda t=t: pool_map(put_pinned, infos, t))
    except Exception as e:  # noqa: BLE001
        print("pinned/put failed:", type(e).__name__, str(e)[:300], flush=True)
        break

CHUNK = 64 << 20


def put_chunked(info):
    a = map_tensor(info)
    if a.nbytes <= 2 * CHUNK:
        return jax.device_put(a, dev).block_until_ready()
    rows = max(1, CHUNK // (a.nbytes // a.shape[0]))
    parts = [jax.device_put(a[r:r + rows], dev) for r in range(0, a.shape[0], rows)]
    return jnp.concatenate(parts).block_until_ready()


for t in (8, 16):
    timed(f"chunked/put threads={t}", lambda t=t: pool_map(put_chunked, infos, t))

