# vLLM's speculative-decoding docs, the older zh translation (shared/seeds/002_*), whose
# code lost its indentation in the copy: re-indented, otherwise verbatim; tests/test_seeds.py
# changes only model names and the `vllm` import.
from openai import OpenAI

# Modify OpenAI's API key and API base to use vLLM's API server.
# 修改 OpenAI 的 API 密钥和 API 库以使用 vLLM 的 API 服务器。
openai_api_key = "EMPTY"
openai_api_base = "http://localhost:8000/v1"
client = OpenAI(
    # defaults to os.environ.get("OPENAI_API_KEY")
    # 默认为 os.environ.get("OPENAI_API_KEY")
    api_key=openai_api_key,
    base_url=openai_api_base,
)
models = client.models.list()
model = models.data[0].id
# Completion API
stream = False
completion = client.completions.create(
    model=model,
    prompt="The future of AI is",
    echo=False,
    n=1,
    stream=stream,
)
print("Completion results:")
if stream:
    for c in completion:
        print(c)
else:
    print(completion)
