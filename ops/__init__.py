"""Decode and augmentation ops, CPU and GPU."""

__all__: list[str] = []
