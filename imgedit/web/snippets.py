""""Copy as API call": the page's current settings as a gradio_client, curl and OpenAI-SDK snippet.

Pure text from the raw form values (no checks: a snippet repeats what the form says, and the server
checks the call when it is made). A new API parameter is one more entry in `api_values`.
"""

from __future__ import annotations

import shlex


def _number(value, default):
    """The form's raw value as int/float, or `default` when it is empty or not a number."""
    if isinstance(value, bool):
        return default
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    return int(number) if number.is_integer() else number


def api_values(n_images: int, prompt, negative_prompt, seed, randomize_seed, num_inference_steps, true_cfg_scale,
               num_images, width, height, default_steps: int, default_cfg: float, speed=None, lora=None,
               lora_scale=None) -> dict:
    """The `/edit` API's keyword arguments for the current form (input files named input-N.png); speed
    and LoRA only when the form sets them."""
    extra = {}
    if isinstance(speed, str) and speed not in ("", "quality"):
        extra["speed"] = speed
    if isinstance(lora, str) and lora not in ("", "none"):
        extra.update(lora=lora, lora_scale=_number(lora_scale, 1.0))
    return {
        "images": [f"input-{i + 1}.png" for i in range(max(1, n_images))],
        "prompt": prompt if isinstance(prompt, str) else "",
        "negative_prompt": negative_prompt if isinstance(negative_prompt, str) else "",
        "seed": _number(seed, 0), "randomize_seed": bool(randomize_seed),
        "num_inference_steps": _number(num_inference_steps, default_steps),
        "true_cfg_scale": _number(true_cfg_scale, default_cfg), "num_images": _number(num_images, 1),
        "width": _number(width, 0), "height": _number(height, 0), **extra,
    }


def gradio_snippet(url: str, values: dict, auth: bool) -> str:
    lines = ["from gradio_client import Client, handle_file", "",
             f"client = Client({url!r}{', auth=(USER, PASSWORD)' if auth else ''})",
             "gallery, seed = client.predict(",
             f"    images=[{', '.join(f'handle_file({name!r})' for name in values['images'])}],"]
    lines += [f"    {key}={value!r}," for key, value in values.items() if key != "images"]
    lines += ['    api_name="/edit",', ")", 'print(gallery[0]["image"], seed)  # a PNG file and the seed used']
    return "\n".join(lines)


def _size(values: dict) -> str:
    width, height = values["width"], values["height"]
    return f"{width}x{height}" if width and height else "auto"


def curl_snippet(url: str, values: dict) -> str:
    fields = [f"image=@{name}" for name in values["images"]] + [
        f"prompt={values['prompt']}", f"negative_prompt={values['negative_prompt']}", f"n={values['num_images']}",
        f"size={_size(values)}", f"num_inference_steps={values['num_inference_steps']}",
        f"true_cfg_scale={values['true_cfg_scale']}"]
    if not values["randomize_seed"]:
        fields.append(f"seed={values['seed']}")
    fields += [f"{key}={values[key]}" for key in ("speed", "lora", "lora_scale") if key in values]
    parts = [f"curl -s {shlex.quote(url + 'v1/images/edits')}", '-H "Authorization: Bearer $API_KEY"']
    parts += [f"-F {shlex.quote(field)}" for field in fields]
    decode = ("| python3 -c 'import sys,json,base64; "
              "open(\"out.png\",\"wb\").write(base64.b64decode(json.load(sys.stdin)[\"data\"][0][\"b64_json\"]))'")
    return " \\\n  ".join([*parts, decode])


def openai_snippet(url: str, values: dict) -> str:
    extra = {"negative_prompt": values["negative_prompt"], "num_inference_steps": values["num_inference_steps"],
             "true_cfg_scale": values["true_cfg_scale"]}
    if not values["randomize_seed"]:
        extra["seed"] = values["seed"]
    extra.update({key: values[key] for key in ("speed", "lora", "lora_scale") if key in values})
    files = ", ".join(f"open({name!r}, 'rb')" for name in values["images"])
    return "\n".join([
        "# pip install openai  (the REST endpoint speaks the OpenAI images API)",
        "import base64", "from openai import OpenAI", "",
        f"client = OpenAI(base_url={url + 'v1'!r}, api_key='your API_KEY (any text if unset)')",
        f"result = client.images.edit(model='qwen-image-edit', image=[{files}],",
        f"                            prompt={values['prompt']!r}, n={values['num_images']!r},",
        f"                            size={_size(values)!r}, response_format='b64_json',",
        f"                            extra_body={extra!r})",
        "open('out.png', 'wb').write(base64.b64decode(result.data[0].b64_json))"])
