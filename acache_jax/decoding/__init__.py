"""Decoding: a request's columns (`layout`), the samplers' commit rules (`sampling`), the affix
cache and anchor selection (`acache`), and the static path's jitted block loop under each cache
policy (`decode`). The engine reuses all but the block loop.
"""
