"""Capture and cache: the key's encoding, tracing and compiling, the in-process and on-disk caches,
specialized gathers, workarounds for Inductor."""
