"""vLLM's own offline greedy output, with and without a LoRA adapter, in a child process (so
its engine and memory go when it exits):

    python -m tests.support.vllm_offline_lora MODEL_DIR ADAPTER_DIR MAX_MODEL_LEN MAX_TOKENS PROMPTS

PROMPTS is a JSON list of token-id lists. Prints one JSON line ``{"base": [...], "lora": [...]}``
with each prompt's generated token ids (``LLM(..., enable_lora=True).generate`` with a
``LoRARequest`` for "lora")."""

from __future__ import annotations

import json
import sys

from tests.support.vllm_stack import use_vllm_env


def main(argv: list[str]) -> None:
    model, adapter, max_model_len, max_tokens, prompts = argv
    use_vllm_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(model, enable_lora=True, max_lora_rank=16, max_model_len=int(max_model_len),
              dtype="float32", enforce_eager=True, block_size=32)
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens))
    inputs = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(prompts)]
    out = {}
    for key, lora in (("base", None), ("lora", LoRARequest("offline", 1, adapter))):
        results = llm.generate(inputs, params, lora_request=lora, use_tqdm=False)
        out[key] = [list(r.outputs[0].token_ids) for r in results]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
