# The SamplingParams walkthrough (shared/seeds/004_*): its numbered interpreter steps and the
# "后续使用" block, in order. Verbatim; tests/test_seeds.py changes only the model path and the
# `vllm` import. Every SamplingParams field the page lists is checked one by one in the test.

# 引入所需的依赖包
from vllm import LLM, SamplingParams

# 加载大模型(这个过程会稍微慢一点)
llm = LLM(model="/mnt/data/NewLLM/THUDM/chatglm3-6b-32k", trust_remote_code=True)

# 配置模型推理参数
sampling_params = SamplingParams(
   top_p=0.9,                # 在采样时，累积概率分布的最高概率。较高的值会增加更多的随机性。
   top_k=3,                  # 在采样时，只考虑累积概率分布中的前 k 个最高概率的标记。
   best_of=6,                # 在多次生成中选择最佳结果的次数，以提高生成文本的质量。
   repetition_penalty=1.2,   # 重复惩罚，惩罚生成与已生成文本中相似的标记的概率。较高的值减少生成文本中的重复。
   temperature=0.7,          # 温度参数，控制生成文本的随机性。较低的值使输出更加确定性，较高的值增加随机性。
   max_tokens=500            # 限制生成的长度，防止生成的文本过长。
)

# 编写提示模板
prompts = [
   "你是谁？",
]

# 让模型思考并反馈(推理生成)
outputs = llm.generate(prompts, sampling_params)

# 打印模型的反馈
for output in outputs:
   prompt = output.prompt
   generated_text = output.outputs[0].text
   print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

# 编写提示模板
prompts = [
    "你在做什么？",
    "请用中文，为我讲一个关于医生的笑话",
]

# 让模型思考并反馈(推理生成)
outputs = llm.generate(prompts, sampling_params)

# 打印模型的反馈
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
