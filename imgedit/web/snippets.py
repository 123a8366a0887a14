""""Copy as API call": the page's current settings as a gradio_client, curl and OpenAI-SDK snippet.

Pure text from the raw form values (no checks: a snippet repeats what the form says, and the server
checks the call when it is made). A declared parameter (protocol.PARAMETERS) is written as the form sets it;
the ones whose controls mean something else (`LAID_OUT`) are written by `api_values` itself.
"""

from __future__ import annotations

import json
import shlex

from imgedit.protocol import EDIT, REST, parameters


def _number(value, default):
    """The form's raw value as int/float, or `default` when it is empty or not a number."""
    if isinstance(value, bool):
        return default
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    return int(number) if number.is_integer() else number


MASK_FILE = "mask.png"
MASK_FIELDS = ("mask_grow", "mask_feather", "strength")


# What api_values writes itself (the form's controls that mean something else than their raw value); every
# other declared parameter the form sets is written as it is (protocol.PARAMETERS).
LAID_OUT = frozenset(("images", "prompt", "negative_prompt", "seed", "randomize_seed",
                      "num_inference_steps", "true_cfg_scale", "num_images", "width", "height", "speed",
                      "lora", "lora_scale", "cache", "mask", *MASK_FIELDS, "enhance_prompt"))


def api_values(form: dict, n_images: int, default_steps: int, default_cfg: float, mask: bool = False,
               generates: bool = False) -> dict:
    """The `/edit` API's keyword arguments for the current form ({declared parameter: the form's raw value};
    input files named input-N.png, the painted mask mask.png); speed, LoRA, step cache and mask only when the
    form sets them, any other declared parameter when it is not its default. `generates`: a model that makes
    an image from the prompt alone, so no input means none (else one placeholder input)."""
    speed, lora, cache = form.get("speed"), form.get("lora"), form.get("cache")
    extra = {}
    if isinstance(speed, str) and speed not in ("", "quality"):
        extra["speed"] = speed
    if isinstance(lora, str) and lora not in ("", "none"):
        extra.update(lora=lora, lora_scale=_number(form.get("lora_scale"), 1.0))
    if isinstance(cache, str) and cache:
        extra["cache"] = cache
    if mask:
        extra.update(mask=MASK_FILE, **{name: _number(form.get(name), None) for name in MASK_FIELDS
                                        if _number(form.get(name), None) is not None})
    for param in parameters(EDIT):
        value = form.get(param.name)
        if param.name in LAID_OUT or value is None or value == "" or value == param.edit_default:
            continue
        extra[param.name] = _number(value, value) if param.kind in ("whole", "number") else value
    prompt, negative = form.get("prompt"), form.get("negative_prompt")
    return {
        "images": [f"input-{i + 1}.png" for i in range(n_images if generates else max(1, n_images))],
        "prompt": prompt if isinstance(prompt, str) else "",
        "negative_prompt": negative if isinstance(negative, str) else "",
        "seed": _number(form.get("seed"), 0), "randomize_seed": bool(form.get("randomize_seed")),
        "num_inference_steps": _number(form.get("num_inference_steps"), default_steps),
        "true_cfg_scale": _number(form.get("true_cfg_scale"), default_cfg),
        "num_images": _number(form.get("num_images"), 1),
        "width": _number(form.get("width"), 0), "height": _number(form.get("height"), 0), **extra,
    }


def _rest_options(values: dict) -> dict:
    """The declared parameters beyond the laid-out ones that REST takes too (sent as they are)."""
    rest = {p.name for p in parameters(REST)}
    return {key: value for key, value in values.items() if key not in LAID_OUT and key in rest}


INPUTS_NOTE = "# The inputs: save the files offered next to this snippet (input-1.png, ...) beside it."
KEY_NOTE = ("# export IMGEDIT_API_KEY=...  (the server's API_KEY, or your key of API_KEYS; "
            "any text when the server has none)")


def gradio_snippet(url: str, values: dict, auth: bool) -> str:
    login = ", auth=(os.environ['IMGEDIT_USER'], os.environ['IMGEDIT_PASSWORD'])" if auth else ""
    lines = [INPUTS_NOTE] if values["images"] else []
    if auth:
        lines += ["# export IMGEDIT_USER=... IMGEDIT_PASSWORD=...  (your login to the page)", "import os"]
    lines += ["from gradio_client import Client, handle_file", "", f"client = Client({url!r}{login})",
              "gallery, seed = client.predict(",
              f"    images=[{', '.join(f'handle_file({name!r})' for name in values['images'])}],"]
    lines += [f"    {key}=handle_file({value!r})," if key == "mask" else f"    {key}={value!r},"
              for key, value in values.items() if key != "images"]
    lines += ['    api_name="/edit",', ")",
              'print(gallery[0]["image"], seed)  # a PNG file and the seed used']
    return "\n".join(lines)


def _size(values: dict) -> str:
    width, height = values["width"], values["height"]
    return f"{width}x{height}" if width and height else "auto"


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


def curl_snippet(url: str, values: dict) -> str:
    if not values["images"]:
        return _curl_generation(url, values)
    fields = [f"image=@{name}" for name in values["images"]] + [
        f"prompt={values['prompt']}", f"negative_prompt={values['negative_prompt']}",
        f"n={values['num_images']}", f"size={_size(values)}",
        f"num_inference_steps={values['num_inference_steps']}", f"true_cfg_scale={values['true_cfg_scale']}"]
    if not values["randomize_seed"]:
        fields.append(f"seed={values['seed']}")
    fields += [f"{key}={values[key]}" for key in ("speed", "lora", "lora_scale", "cache") if key in values]
    if "mask" in values:
        fields += [f"mask=@{values['mask']}"]
        fields += [f"{key}={values[key]}" for key in MASK_FIELDS if key in values]
    fields += [f"{key}={value}" for key, value in _rest_options(values).items()]
    parts = [f"curl -sS {shlex.quote(url + 'v1/images/edits')}",
             '-H "Authorization: Bearer $IMGEDIT_API_KEY"']
    parts += [f"-F {shlex.quote(field)}" for field in fields]
    command = " \\\n  ".join([*parts, f"| python3 -c {shlex.quote(_DECODE)}"])
    return "\n".join([INPUTS_NOTE, KEY_NOTE, command])


def _extensions(values: dict) -> dict:
    """Our parameters beyond OpenAI's, as REST takes them (the openai SDK sends them through extra_body)."""
    extra = {"negative_prompt": values["negative_prompt"],
             "num_inference_steps": values["num_inference_steps"],
             "true_cfg_scale": values["true_cfg_scale"]}
    if not values["randomize_seed"]:
        extra["seed"] = values["seed"]
    extra.update({key: values[key] for key in ("speed", "lora", "lora_scale", "cache", *MASK_FIELDS)
                  if key in values})
    extra.update(_rest_options(values))
    return extra


def _curl_generation(url: str, values: dict) -> str:
    """Text to image: OpenAI's generations, a JSON body."""
    body = {"prompt": values["prompt"], "n": values["num_images"], "size": _size(values),
            "response_format": "b64_json", **_extensions(values)}
    parts = [f"curl -sS {shlex.quote(url + 'v1/images/generations')}",
             '-H "Authorization: Bearer $IMGEDIT_API_KEY"',
             "-H 'Content-Type: application/json'", f"-d {shlex.quote(json.dumps(body))}"]
    return "\n".join([KEY_NOTE, " \\\n  ".join([*parts, f"| python3 -c {shlex.quote(_DECODE)}"])])


def openai_snippet(url: str, values: dict) -> str:
    extra = _extensions(values)
    if not values["images"]:  # text to image
        return "\n".join([
            "# pip install openai  (the REST endpoint speaks the OpenAI images API)", KEY_NOTE,
            "import base64", "import os", "from openai import OpenAI", "",
            f"client = OpenAI(base_url={url + 'v1'!r}, api_key=os.environ.get('IMGEDIT_API_KEY', 'none'))",
            f"result = client.images.generate(model='qwen-image', prompt={values['prompt']!r},",
            f"                                n={values['num_images']!r}, size={_size(values)!r},",
            "                                response_format='b64_json',",
            f"                                extra_body={extra!r})",
            "open('out.png', 'wb').write(base64.b64decode(result.data[0].b64_json))",
            "print('wrote out.png')"])
    files = ", ".join(f"open({name!r}, 'rb')" for name in values["images"])
    mask = f" mask=open({values['mask']!r}, 'rb')," if "mask" in values else ""
    return "\n".join([
        "# pip install openai  (the REST endpoint speaks the OpenAI images API)", INPUTS_NOTE, KEY_NOTE,
        "import base64", "import os", "from openai import OpenAI", "",
        f"client = OpenAI(base_url={url + 'v1'!r}, api_key=os.environ.get('IMGEDIT_API_KEY', 'none'))",
        f"result = client.images.edit(model='qwen-image-edit', image=[{files}],",
        f"                            prompt={values['prompt']!r}, n={values['num_images']!r},{mask}",
        f"                            size={_size(values)!r}, response_format='b64_json',",
        f"                            extra_body={extra!r})",
        "open('out.png', 'wb').write(base64.b64decode(result.data[0].b64_json))", "print('wrote out.png')"])
