# vLLM's speculative-decoding docs (the zh translation, shared/seeds/001_*), block 5. Verbatim;
# tests/test_seeds.py changes only model names and the `vllm` import. One repair: the
# translation garbled `{"model": ...` into `{"        "model": ...` (vLLM's English page has
# `{"model": ...`), which Python reads as the key "        model".
from vLLM import LLM, SamplingParams

prompts = [
    "人工智能的未来是",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(
    model="meta-llama/Meta-Llama-3-8B-Instruct",
    tensor_parallel_size=4,
    speculative_config={
        "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B",
        "draft_tensor_parallel_size": 1,
    },
)

outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"提示: {prompt!r}, 生成的文本: {generated_text!r}")

