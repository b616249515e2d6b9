"""``hf-tpu serve`` replicas behind one Ray Serve endpoint (hf_tpu.ray.serve) on a local 2-node cluster of simulated
TPU VMs: one replica per node, the openai client against the one endpoint, greedy answers equal to the CPU's
``generate`` (as one ``hf-tpu serve`` answers, tests/serving/test_server.py), streamed and plain, from both replicas.
The replicas share a compile-cache directory, as on a pod: they warm up one after the other, the second loading the
step graphs the first compiled. Slow: two servers warming up on a 2-core host.
"""

from __future__ import annotations

import concurrent.futures
import functools

import pytest
from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu.assets import default_model_path
from hf_tpu.ray.local import free_port, heldout_prompts, simulated_cluster

MODEL = str(default_model_path())  # the model that ships with hf_tpu, with its tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (--dist loadgroup)
ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

# hf-tpu serve's smallest ladder for the shipped model (as tests/serving/_server.py's SMALL_FLAGS)
SMALL_FLAGS = ["--slots", "4", "--max-batch-tokens", "32", "--min-step-tokens", "32"]


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    from ray import serve

    from hf_tpu.ray.serve import build_app

    cache = tmp_path_factory.mktemp("compile-cache")
    with simulated_cluster(nodes=2):
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        try:
            app = build_app(num_replicas=2, simulate=True, serve_args=SMALL_FLAGS, compile_cache=cache,
                            startup_timeout_s=SAFETY_TIMEOUT_S)  # fmt: skip
            serve.run(app, route_prefix="/")
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()


@pytest.fixture(scope="module")
def cpu():
    """The shipped model's greedy text on CPU, with the model's own repetition penalty (the server honours it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL).eval()

    @functools.cache  # (the streamed answer's prompt is asked twice)
    def text(prompt: str, new_tokens: int) -> str:
        ids = tok(prompt)["input_ids"]
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        return tok.decode(out[0, len(ids) :], skip_special_tokens=True)

    return text


def test_replicas_behind_one_endpoint_answer_the_openai_client_greedy_equal_to_cpu(endpoint, cpu):
    from hf_tpu.ray.serve import REPLICA_HEADER

    client = openai.OpenAI(base_url=endpoint + "/v1", api_key="unused", timeout=SAFETY_TIMEOUT_S, max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    prompts = heldout_prompts(16)

    def ask(i: int) -> tuple[str, str]:
        raw = client.completions.with_raw_response.create(model=model, prompt=prompts[i], max_tokens=6, temperature=0)
        return raw.parse().choices[0].text, raw.headers[REPLICA_HEADER]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(len(prompts))))
    assert [text for text, _ in answers] == [cpu(p, 6) for p in prompts]
    assert len({replica for _, replica in answers}) == 2  # both replicas answered

    stream = client.completions.create(model=model, prompt=prompts[0], max_tokens=6, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == cpu(prompts[0], 6)
