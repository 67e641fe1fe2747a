"""Fast CPU paths (packed GGUF linears, int8, attention), each with a plain-torch equal."""
