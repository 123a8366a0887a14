"""REST for scripts and OpenAI clients: the routes (`rest.py`: edits, generations, /health, /metrics), their
requests (`rest_requests.py`), the async jobs API (`jobs.py`) and OpenAI's error shape (`errors.py`).
Imports the engine, planning and config; never the page."""
