# vLLM's speculative-decoding docs (the zh translation, shared/seeds/001_*), block 2. Verbatim;
# tests/test_seeds.py changes only model names and the `vllm` import.
from openai import OpenAI

# 修改 OpenAI 的 API 密钥和 API 基础地址以使用 vLLM 的 API 服务器。
openai_api_key = "EMPTY"
openai_api_base = "http://localhost:8000/v1"

client = OpenAI(
    # 默认为 os.environ.get("OPENAI_API_KEY")
    api_key=openai_api_key,
    base_url=openai_api_base,
)

models = client.models.list()
model = models.data[0].id

# 补全 API
stream = False
completion = client.completions.create(
    model=model,
    prompt="人工智能的未来是",
    echo=False,
    n=1,
    stream=stream,
)

print("补全结果:")
if stream:
    for c in completion:
        print(c)
else:
    print(completion)
