""""Copy as API call": the page's current settings as a gradio_client, curl and OpenAI-SDK snippet.

Pure text from the raw form values (no checks: a snippet repeats what the form says, and the server
checks the call when it is made). Every parameter is written as its declaration says (protocol.PARAMETERS:
`always`, `beside`, `unless`, `openai`, its REST name and kind); nothing here lists them.
"""

from __future__ import annotations

import json
import shlex

from imgedit.errors import InvalidInput
from imgedit.protocol import EDIT, REST, Param, param, parameters

MASK_FILE = "mask.png"
INPUTS_NOTE = "# The inputs: save the files offered next to this snippet (input-1.png, ...) beside it."
KEY_NOTE = ("# export IMGEDIT_API_KEY=...  (the server's API_KEY, or your key of API_KEYS; "
            "any text when the server has none)")
# The reply's first image to out.png, or the server's error message (exit status 1) when there is none.
_DECODE = ("import sys, json, base64\n"
           "raw = sys.stdin.buffer.read()\n"
           "try:\n    reply = json.loads(raw)\n"
           "except ValueError:\n"
           "    sys.exit(\"the server answered: \" + raw[:500].decode(errors=\"replace\"))\n"
           "if \"data\" not in reply:\n"
           "    sys.exit(\"the server answered: \" + str(reply.get(\"error\", reply)))\n"
           "open(\"out.png\", \"wb\").write(base64.b64decode(reply[\"data\"][0][\"b64_json\"]))\n"
           "print(\"wrote out.png\")")


def _form_value(p: Param, raw, default):
    """The form's raw value parsed by its kind (protocol.Param.parse), or `default` where it is empty or
    not of its kind: a snippet repeats the form and the server checks the call."""
    if raw is None or raw == "":
        return False if p.kind == "flag" else default
    try:
        return p.parse(raw)
    except InvalidInput:
        return default


def input_files(n_images: int, mask: bool = False, generates: bool = False) -> dict:
    """The snippets' files by parameter: input-N.png for the inputs (`generates`: a model that makes an
    image from the prompt alone, so no input means none; else one placeholder input), mask.png for a painted
    mask."""
    count = n_images if generates else max(1, n_images)
    files: dict = {"images": [f"input-{i + 1}.png" for i in range(count)]}
    if mask:
        files["mask"] = MASK_FILE
    return files


def api_values(form: dict, files: dict, defaults: dict) -> dict:
    """The `/edit` API's keyword arguments for the current form ({declared parameter: the form's raw value}):
    `files` by parameter (input_files), `defaults` the model family's where a parameter's own default is "the
    model's" (steps, CFG scale). A parameter declared `always` is written whatever the form says, one `beside`
    another only with it, any other only when the form sets it (not empty, not its default)."""
    values: dict = {}
    for p in parameters(EDIT):
        if p.kind == "file":
            if p.name in files:
                values[p.name] = files[p.name]
            continue
        if p.beside is not None and p.beside not in values:
            continue
        value = _form_value(p, form.get(p.name), defaults.get(p.name, p.edit_default))
        if p.always or p.beside is not None:
            if value is not None:
                values[p.name] = value
        elif value not in (None, "", p.edit_default):
            values[p.name] = value
    return values


def _size(values: dict) -> str:
    """REST's `size` (kind size: OpenAI's WIDTHxHEIGHT) from the form's width and height."""
    width, height = values.get("width"), values.get("height")
    return f"{width}x{height}" if width and height else "auto"


def rest_values(values: dict) -> dict:
    """`api_values` as REST takes them, by their REST names, in the declaration's order: the size as WxH, a
    parameter left out where its `unless` switch is on (the seed of a randomized edit)."""
    out: dict = {}
    for p in parameters(REST):
        if p.kind == "size":
            out[p.form_name] = _size(values)
        elif p.name in values and not (p.unless is not None and values.get(p.unless)):
            out[p.form_name] = values[p.name]
    return out


def _kind(rest_name: str) -> Param:
    return next(p for p in parameters(REST) if p.form_name == rest_name)


def _extensions(rest: dict) -> dict:
    """Our parameters beyond OpenAI's own (the openai SDK sends them through extra_body)."""
    return {key: value for key, value in rest.items() if not _kind(key).openai}


def gradio_snippet(url: str, values: dict, auth: bool) -> str:
    login = ", auth=(os.environ['IMGEDIT_USER'], os.environ['IMGEDIT_PASSWORD'])" if auth else ""
    lines = [INPUTS_NOTE] if values["images"] else []
    if auth:
        lines += ["# export IMGEDIT_USER=... IMGEDIT_PASSWORD=...  (your login to the page)", "import os"]
    lines += ["from gradio_client import Client, handle_file", "", f"client = Client({url!r}{login})",
              "gallery, seed = client.predict("]
    for key, value in values.items():
        if isinstance(value, list):  # files
            lines.append(f"    {key}=[{', '.join(f'handle_file({name!r})' for name in value)}],")
        elif param(key).kind == "file":
            lines.append(f"    {key}=handle_file({value!r}),")
        else:
            lines.append(f"    {key}={value!r},")
    lines += ['    api_name="/edit",', ")",
              'print(gallery[0]["image"], seed)  # a PNG file and the seed used']
    return "\n".join(lines)


def curl_snippet(url: str, values: dict) -> str:
    if not values["images"]:
        return _curl_generation(url, values)
    fields = []
    for key, value in rest_values(values).items():
        if _kind(key).kind == "file":
            fields += [f"{key}=@{name}" for name in (value if isinstance(value, list) else [value])]
        else:
            fields.append(f"{key}={value}")
    parts = [f"curl -sS {shlex.quote(url + 'v1/images/edits')}",
             '-H "Authorization: Bearer $IMGEDIT_API_KEY"']
    parts += [f"-F {shlex.quote(field)}" for field in fields]
    command = " \\\n  ".join([*parts, f"| python3 -c {shlex.quote(_DECODE)}"])
    return "\n".join([INPUTS_NOTE, KEY_NOTE, command])


def _curl_generation(url: str, values: dict) -> str:
    """Text to image: OpenAI's generations, a JSON body."""
    rest = {key: value for key, value in rest_values(values).items() if _kind(key).kind != "file"}
    own = {key: value for key, value in rest.items() if _kind(key).openai}
    body = {**own, "response_format": "b64_json", **_extensions(rest)}
    parts = [f"curl -sS {shlex.quote(url + 'v1/images/generations')}",
             '-H "Authorization: Bearer $IMGEDIT_API_KEY"',
             "-H 'Content-Type: application/json'", f"-d {shlex.quote(json.dumps(body))}"]
    return "\n".join([KEY_NOTE, " \\\n  ".join([*parts, f"| python3 -c {shlex.quote(_DECODE)}"])])


def openai_snippet(url: str, values: dict) -> str:
    generation = not values["images"]  # text to image: no files
    rest = {key: value for key, value in rest_values(values).items()
            if not (generation and _kind(key).kind == "file")}
    arguments = []
    for key, value in rest.items():
        if not _kind(key).openai:
            continue
        if _kind(key).kind == "file":
            opened = [f"open({name!r}, 'rb')" for name in (value if isinstance(value, list) else [value])]
            listed = f"[{', '.join(opened)}]" if isinstance(value, list) else opened[0]
            arguments.append(f"{key}={listed}")
        else:
            arguments.append(f"{key}={value!r}")
    call, model = ("generate", "qwen-image") if generation else ("edit", "qwen-image-edit")
    return "\n".join([
        "# pip install openai  (the REST endpoint speaks the OpenAI images API)",
        *([] if generation else [INPUTS_NOTE]), KEY_NOTE,
        "import base64", "import os", "from openai import OpenAI", "",
        f"client = OpenAI(base_url={url + 'v1'!r}, api_key=os.environ.get('IMGEDIT_API_KEY', 'none'))",
        f"result = client.images.{call}(",
        f"    model={model!r},",
        *(f"    {argument}," for argument in arguments),
        "    response_format='b64_json',",
        f"    extra_body={_extensions(rest)!r},",
        ")",
        "open('out.png', 'wb').write(base64.b64decode(result.data[0].b64_json))", "print('wrote out.png')"])
