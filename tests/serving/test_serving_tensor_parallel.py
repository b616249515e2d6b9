"""``hf-tpu serve --simulate --tp 2``: two ranks through hf_tpu's launcher, rank 0 serving HTTP on 127.0.0.1;
concurrent greedy requests equal CPU ``generate`` (= TP=1), and SIGTERM ends every rank."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import psutil
from _server import running_server
from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu.assets import default_model_path

PROMPTS = ["The king said", "O Romeo,", "To be or not"]


def test_tp2_server_answers_equal_cpu_greedy_and_sigterm_ends_every_rank(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    cpu = AutoModelForCausalLM.from_pretrained(path).eval()
    expected = []
    for i, prompt in enumerate(PROMPTS):  # greedy with the model's own repetition penalty, which the server honours
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        out = cpu.generate(ids, max_new_tokens=4 + i, do_sample=False)
        expected.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))

    with running_server(tmp_path, "--tp", "2", "--slots", "2") as server:  # KV rungs 0, 256, 512: 3 step shapes
        rank_command = "hf_tpu.distributed._bootstrap --module hf_tpu.cli serve"  # each rank runs `hf-tpu serve`
        ranks = [p for p in psutil.Process(server.proc.pid).children(recursive=True) if rank_command in
                 " ".join(p.cmdline())]  # fmt: skip
        assert len(ranks) == 2, [p.cmdline() for p in ranks]
        assert "tensor parallel over 2 ranks" in server.output()

        def one(i):
            body = {"model": "tiny-lm", "prompt": PROMPTS[i], "max_tokens": 4 + i, "temperature": 0}
            status, answer, _ = server.post("/v1/completions", body)
            assert status == 200, answer
            return answer["choices"][0]["text"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(one, range(len(PROMPTS))))
        assert got == expected
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=SAFETY_TIMEOUT_S)
        _, alive = psutil.wait_procs(ranks, timeout=SAFETY_TIMEOUT_S)
        assert not alive, f"ranks left running after SIGTERM: {[p.pid for p in alive]}\n{server.output()[-3000:]}"


def test_a_tp_size_torch_tpu_cannot_lay_out_is_refused_in_the_commands_words(capsys):
    from hf_tpu.cli.main import main

    assert main(["serve", "--simulate", "--tp", "3"]) != 0  # before any rank starts
    err = capsys.readouterr().err
    assert "--tp 3" in err and "Pass --tp 2" in err and "nproc_per_node" not in err
