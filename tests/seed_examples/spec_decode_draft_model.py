# vLLM's speculative-decoding docs (the zh translation, shared/seeds/001_*), block 1. Verbatim;
# tests/test_seeds.py changes only model names and the `vllm` import.
from vllm import LLM, SamplingParams

prompts = [
    "人工智能的未来是",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(
    model="facebook/opt-6.7b",
    tensor_parallel_size=1,
    speculative_config={
        "model": "facebook/opt-125m",
        "num_speculative_tokens": 5,
    },
)
outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"提示: {prompt!r}, 生成的文本: {generated_text!r}")
