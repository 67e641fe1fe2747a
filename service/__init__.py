"""The engine side of the server (no HTTP here): `runtime` composes what a server runs; `engine`
steps the batch; `controller` decides how much to speculate; `model` and `kernels` run the
passes; `model_drafts` drafts with a model; `bench` measures it all."""
