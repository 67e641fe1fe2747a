"""The engine: model runner, KV cache, token tree, verifier and the decode loop."""
