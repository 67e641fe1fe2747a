"""Batch jobs, OpenAI's Files and Batches APIs: uploaded JSONL files of requests (`lines.py`),
kept with every finished line in a durable store (`store.py`: SQLite for one server in
`sqlite_store.py`, PostgreSQL shared by replicas in `postgres_store.py`, `opening.py` picking
one), and run line by line through the server's own routes at idle priority, each batch under
a lease (`runner.py`)."""
