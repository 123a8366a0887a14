"""The page's own script and style, outside Gradio's components: Ctrl+Enter, the phone layout, the upload-size
message in the setting's words, and the input thumbnails' grid. `page_head` goes into the page's <head>
(imgedit.web.app); INPUT_PREVIEW_CSS into the editor (imgedit.web.page.blocks)."""

from __future__ import annotations

import json

from imgedit.config.parsers import human_size
from imgedit.config.settings import Settings


def page_head(settings: Settings) -> str:
    """Ctrl+Enter runs the edit; on a phone, Edit scrolls to the progress; Gradio's own upload-size message
    ("exceed the maximum allowed size of 23.8 Mb" for MAX_FILE_SIZE=25MB: it counts in MiB and says Mb) says
    the limit as the setting wrote it."""
    largest = human_size(settings.max_file_size)
    limit = json.dumps(f"larger than {largest}, the largest upload this server takes (MAX_FILE_SIZE)")
    return PAGE_SCRIPT.replace("__LIMIT__", limit.replace("</", "<\\/"))


# Ctrl/Cmd+Enter in the prompt runs the edit; on a phone the result (with its progress) scrolls into view;
# Gradio's upload-size message gets the limit as written (__LIMIT__, filled in by page_head).
PAGE_SCRIPT = """<script>
document.addEventListener('keydown', (e) => {
  if (e.key === 'Enter' && (e.ctrlKey || e.metaKey) && e.target.closest && e.target.closest('#prompt')) {
    e.preventDefault();
    document.getElementById('edit-button')?.click();
  }
});
document.addEventListener('click', (e) => {
  if (window.innerWidth < 900 && e.target.closest && e.target.closest('#edit-button')) {
    setTimeout(() => document.getElementById('result')?.scrollIntoView({block: 'start'}), 150);
  }
}, true);
const SIZE_RE = /File\\(s\\) exceed the maximum allowed size of [0-9.]+ \\w+: (.*)/;
function sayTheLimit() {
  const found = document.evaluate("//text()[contains(., 'maximum allowed size of')]", document.body, null,
                                  XPathResult.ORDERED_NODE_SNAPSHOT_TYPE, null);
  for (let i = 0; i < found.snapshotLength; i++) {
    const node = found.snapshotItem(i), match = node.textContent.match(SIZE_RE);
    if (match) node.textContent = match[1] + ': ' + __LIMIT__;
  }
}
let sizeFrame = 0;
new MutationObserver(() => {
  if (!sizeFrame) sizeFrame = requestAnimationFrame(() => { sizeFrame = 0; sayTheLimit(); });
}).observe(document.documentElement, {subtree: true, childList: true, characterData: true});
</script>"""


# Fixed-size thumbnail cells: one input would otherwise fill the column's width. On a narrow screen (the
# columns stack below about 2 x 320 px) the result column comes right after the Edit button and its message,
# before Examples, Speed, LoRA, Mask and Advanced (#editor-more): the columns give their children to the row.
# There the Edit button scrolls to the result; the browser's scroll anchoring would then keep a later
# element in place as the live preview appears under the result, pushing the result's top off the screen:
# it is off there.
INPUT_PREVIEW_CSS = """<style>
#input-preview .grid-container{grid-template-columns:repeat(auto-fill,120px)!important;
  grid-template-rows:none!important;grid-auto-rows:120px!important}
#input-preview img{object-fit:contain!important}
#chain-strip .grid-container{grid-template-columns:repeat(auto-fill,110px)!important;
  grid-template-rows:none!important;grid-auto-rows:110px!important}
#chain-strip img{object-fit:contain!important}
@media (max-width: 700px) {
  #editor{flex-direction:column!important;flex-wrap:nowrap!important}
  #editor-left,#editor-right{display:contents!important}
  #editor-right>*{order:1}
  #editor-more{order:2}
  html,body{overflow-anchor:none}
}
</style>"""
