"""Everything that touches the model's tensors: loading, the pass, attention, the KV cache."""
