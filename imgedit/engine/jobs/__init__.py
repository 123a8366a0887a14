"""Jobs that outlive a request: batches and the async jobs (`batch.py`), their items' states on disk
(`records.py`) and the History of finished edits (`history.py`). Imports planning and config."""
