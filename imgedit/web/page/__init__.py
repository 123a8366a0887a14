"""The browser page and the gradio API (the page's events are the API): the Blocks (`blocks.py`), its tabs
(Batch, History), controls (mask, speed, sizes, rewrite), the edit chain, the GPU panel's HTML, the progress
text, the Copy-as-API snippets, the events' requests (`requests.py`), uploads and the exact cancel route,
and the page's own script and style. Imports the engine, planning and config; never the REST routes."""
