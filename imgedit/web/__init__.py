"""The web edge: the Gradio page and its tabs, the gradio API, REST (OpenAI-style edits, async
jobs, /health, /metrics), uploads, identity, the GPU panel; `web.app` wires them into one app.

Never imports torch. May import `imgedit.engine` and everything below it on the server side.
"""
