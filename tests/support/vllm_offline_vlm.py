"""vLLM's own offline greedy output for image prompts, in a child process (so its engine and
memory go when it exits):

    python -m tests.support.vllm_offline_vlm MODEL_DIR MAX_MODEL_LEN MAX_TOKENS CASES

CASES is a JSON list of ``[prompt_token_ids, image_path]``: each prompt holds one ``<image>``
token (vLLM expands it), the image a file PIL reads. Prints one JSON line: each case's generated
token ids (``LLM(..., model_impl="transformers").generate`` with ``multi_modal_data``)."""

from __future__ import annotations

import json
import sys

from tests.support.vllm_stack import use_vllm_env


def main(argv: list[str]) -> None:
    model, max_model_len, max_tokens, cases = argv
    use_vllm_env()
    from PIL import Image
    from vllm import LLM, SamplingParams

    llm = LLM(model, model_impl="transformers", max_model_len=int(max_model_len),
              dtype="float32", enforce_eager=True, block_size=32)
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens))
    inputs = []
    for ids, path in json.loads(cases):
        with Image.open(path) as img:
            inputs.append({"prompt_token_ids": ids,
                           "multi_modal_data": {"image": img.convert("RGB")}})
    results = llm.generate(inputs, params, use_tqdm=False)
    print(json.dumps([list(r.outputs[0].token_ids) for r in results]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
