"""Tensor parallelism: one model copy over several ranks (`--tensor-parallel-size`)."""
