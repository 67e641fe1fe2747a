"""The speculating round on the model's device: drafts grown by gathers, a batched tree check, the
KV kept by one gather, and one copy to the host."""
