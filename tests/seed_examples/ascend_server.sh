# The Ascend page's table of vLLM's speculative parameters (shared/seeds/003_*): step 1, the
# server command. Verbatim; tests/test_seeds.py changes only the two model paths and drops the
# `# ...` comments that follow the line-continuation backslashes (as written they end the command
# after its first line, in any shell).
base_model=/path/to/base_model
spec_model=/path/to/spec_model
spec_step=3
spec_parallel=1
python -m vllm.entrypoints.openai.api_server \
--model=${base_model} \   # 大模型权重地址
--speculative-model=${spec_model} \   # 投机小模型权重地址
--num-speculative-tokens=${spec_step} \ #投机步数
--speculative-draft-tensor-parallel-size=${spec_parallel} \ #投机小模型使用的卡数,通常设置为1
--tensor-parallel-size=1 \
--host 0.0.0.0 \
--port 9999 \
--dtype auto \
--gpu-memory-utilization=0.9 \
--served-model-name test_server_demo \
--trust-remote-code
