"""Benchmarks: each module is a command (``python bench/images.py --help``); ``gpuio bench`` runs the storage and image benches."""
