"""Batch jobs, OpenAI's Files and Batches APIs: uploaded JSONL files of requests (`lines.py`),
kept with every finished line in a durable store (`store.py`), and run line by line through the
server's own routes at idle priority (`runner.py`)."""
