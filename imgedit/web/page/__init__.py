"""The browser page and the gradio API (the page's events are the API): the Blocks (`blocks.py`), the Edit
tab's layout (`editor.py`) and events (`edit_events.py`), the other tabs (Batch, History), controls (made
from the declaration: `controls.py`; mask, speed, sizes, rewrite), the edit chain, the GPU panel's HTML, the
progress text, the Copy-as-API snippets, the events' requests (`requests.py`), uploads and the exact cancel
route, and the page's own script and style. Imports the engine, planning and config; never the REST routes."""
