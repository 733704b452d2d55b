"""PDM training (train/distill.py, train/data_parallel.py): the loss falls, a resumed run equals an
uninterrupted one, snapshots are loadable heads, two data-parallel gloo ranks take the same steps
as one process on the joint batch, bf16 autocast tracks fp32, self-distillation never answers a
prompt twice."""
from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import full_model, tiny_engine_config
from test_corpus import build

from spd_engine.engine.model.pdm import load_pdm, read_pdm_config
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.launch import spd_script
from spd_engine.train.corpus import Corpus
from spd_engine.train.data_parallel import DataParallel
from spd_engine.train.distill import TrainConfig, Trainer, distill_loss
from spd_engine.train.head_transplant import anchor_map
from spd_engine.train.self_distill import pick_prompts

ECFG = tiny_engine_config("llama", n=2)
S = 24


def target():
    m = full_model(ECFG).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def tcfg(out: Path, **kw) -> TrainConfig:
    base = dict(out=str(out), stage_layers=tuple(ECFG.parallel.topology.stage_layers), seq_len=S, batch=4, steps=6,
                lr=2e-3, warmup=2, save_every=3, autocast="float32")
    base.update(kw)
    return TrainConfig(**base)


def stream(batch: int = 4, distinct: int | None = None, seed: int = 0) -> Iterator[torch.Tensor]:
    """Seeded random token batches [batch, S]; with `distinct`, the same few batches cycle."""
    g = torch.Generator().manual_seed(seed)
    cache: list[torch.Tensor] = []
    while True:
        if distinct is not None and len(cache) == distinct:
            yield from cache
            continue
        b = torch.randint(0, ECFG.model.cfg.vocab_size, (batch, S), generator=g)
        cache.append(b)
        yield b


def params(tr: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.pdm.state_dict().items()}


def test_loss_falls(tmp_path: Path) -> None:
    tr = Trainer(target(), tcfg(tmp_path, steps=60, save_every=60, full_fill_frac=1.0), stream(distinct=2),
                 log=lambda m: None)
    tr.run()
    losses = [h["loss"] for h in tr.history]
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.7 * first, (first, last)


class Interrupted(Exception):
    pass


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    straight = Trainer(target(), tcfg(tmp_path / "a"), stream(), log=lambda m: None)
    straight.run()

    def cut(it: Iterator, k: int) -> Iterator:
        for _ in range(k):
            yield next(it)
        raise Interrupted

    first = Trainer(target(), tcfg(tmp_path / "b"), cut(stream(), 4), log=lambda m: None)
    with pytest.raises(Interrupted):
        first.run()  # saved at step 3, died in step 4
    logs: list[str] = []
    resumed = Trainer(target(), tcfg(tmp_path / "b"), stream(), log=logs.append)
    assert resumed.step == 3 and "resumed from step 3" in logs
    resumed.run()
    want, got = params(straight), params(resumed)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert [h["loss"] for h in straight.history] == [h["loss"] for h in resumed.history]


def test_resume_refuses_other_split(tmp_path: Path) -> None:
    Trainer(target(), tcfg(tmp_path, steps=3), stream(), log=lambda m: None).run()
    with pytest.raises(ValueError, match="stage layers"):
        Trainer(target(), tcfg(tmp_path, stage_layers=(1, 3)), stream(), log=lambda m: None)


def test_snapshots_are_heads(tmp_path: Path) -> None:
    tr = Trainer(target(), tcfg(tmp_path, steps=4, keep_every=2, save_every=4), stream(), log=lambda m: None)
    tr.run()
    snaps = sorted(p.name for p in (tmp_path / "snapshots").iterdir())
    assert snaps == ["step-000002", "step-000004"]
    _, meta = read_pdm_config(tmp_path / "snapshots" / "step-000002")
    assert meta["train"]["step"] == 2 and meta["train"]["tokens"] == 2 * 4 * S
    final = load_pdm(tmp_path / "pdm", ECFG.model.cfg, tuple(ECFG.parallel.topology.stage_layers))
    for (k, a), b in zip(final.state_dict().items(), tr.pdm.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), atol=1e-3, rtol=1e-3), k  # fp16 export


def test_init_head_starts_from_its_weights_and_checks_config(tmp_path: Path) -> None:
    """A fine-tune starts from the exported head (its loss at step 0 is the head's, below a fresh
    head's) and refuses a head of another K."""
    first = Trainer(target(), tcfg(tmp_path / "a", steps=30, save_every=30, full_fill_frac=1.0, export_dtype="float32"),
                    stream(distinct=2), log=lambda m: None)
    first.run()
    tuned = Trainer(target(), tcfg(tmp_path / "b", steps=1, full_fill_frac=1.0, init_head=str(tmp_path / "a" / "pdm")),
                    stream(distinct=2), log=lambda m: None)
    want = first.pdm.state_dict()
    assert all(torch.equal(want[k], v) for k, v in tuned.pdm.state_dict().items())
    fresh = Trainer(target(), tcfg(tmp_path / "c", steps=1, full_fill_frac=1.0), stream(distinct=2), log=lambda m: None)
    tuned.run(), fresh.run()
    assert tuned.history[0]["loss"] < 0.8 * fresh.history[0]["loss"]
    assert any(p.requires_grad for p in tuned.pdm.parameters()) and not tuned.pdm.final_norm.weight.requires_grad
    with pytest.raises(ValueError, match="num_layers 1, this run has 2"):
        Trainer(target(), tcfg(tmp_path / "d", pdm_layers=2, init_head=str(tmp_path / "a" / "pdm")), stream(),
                log=lambda m: None)


def test_init_head_of_another_split_warm_starts(tmp_path: Path) -> None:
    """A head trained for n=2 starts an n=4 head (layers and head copied, projections mapped by
    anchor depth): its step-0 loss is well below a fresh head's; another K is still refused."""
    first = Trainer(target(), tcfg(tmp_path / "a", steps=30, save_every=30, full_fill_frac=1.0, export_dtype="float32"),
                    stream(distinct=2), log=lambda m: None)
    first.run()
    n4 = tuple(Topology.build(ECFG.model.cfg.num_layers, 4).stage_layers)
    moved = Trainer(target(), tcfg(tmp_path / "b", stage_layers=n4, steps=1, full_fill_frac=1.0,
                                   init_head=str(tmp_path / "a" / "pdm")), stream(distinct=2), log=lambda m: None)
    assert moved.pdm.pcfg.stage_layers == n4
    src = first.pdm.state_dict()
    assert all(torch.equal(src[k], v) for k, v in moved.pdm.state_dict().items() if not k.startswith("proj."))
    fresh = Trainer(target(), tcfg(tmp_path / "c", stage_layers=n4, steps=1, full_fill_frac=1.0), stream(distinct=2),
                    log=lambda m: None)
    moved.run(), fresh.run()
    assert moved.history[0]["loss"] < 0.8 * fresh.history[0]["loss"]
    with pytest.raises(ValueError, match="num_layers 1, this run has 2"):
        Trainer(target(), tcfg(tmp_path / "d", stage_layers=n4, pdm_layers=2, init_head=str(tmp_path / "a" / "pdm")),
                stream(), log=lambda m: None)


def test_anchor_map_pairs_nearest_depths() -> None:
    """SmolLM2's n=4 anchors (0, 8, 23, 29) into n=2's (0, 15, 29): each new anchor reads the
    nearest source block, deepest first, from the source type of the nearest deepest anchor."""
    src, dst = (0, 8, 23, 29), (0, 15, 29)
    assert anchor_map(src, dst, 0) == (0, {0: 0})
    assert anchor_map(src, dst, 1) == (1, {1: 1, 0: 0})  # 15 is nearer 8 than 23
    assert anchor_map(src, dst, 2) == (3, {2: 3, 1: 1, 0: 0})
    assert anchor_map(dst, src, 1) == (1, {1: 1, 0: 0})  # 8 is nearer 15 than 0
    assert anchor_map(dst, src, 2) == (2, {2: 2, 1: 1, 0: 0})  # 23 is nearer 29 than 15
    assert anchor_map((0, 29), src, 2) == (1, {2: 1, 1: 0})  # two source blocks: anchor 0 gets none


def test_bf16_autocast_tracks_fp32() -> None:
    tr_cfg = tcfg(Path("/nonexistent"))
    from spd_engine.train.distill import new_pdm
    pdm = new_pdm(target(), tr_cfg, None)
    tokens = next(stream())
    l32, a32 = distill_loss(pdm, target(), tokens, 2, "float32")
    l16, a16 = distill_loss(pdm, target(), tokens, 2, "bfloat16")
    assert abs(float(l16.detach()) - float(l32.detach())) < 0.02 * float(l32.detach())
    assert abs(float(a16) - float(a32)) < 0.05
    with pytest.raises(ValueError, match="autocast"):
        tcfg(Path("/x"), autocast="int8")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dp_rank(rank: int, world: int, port: int, out: str, q) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dp = DataParallel(rank, world)
    tr = Trainer(target(), tcfg(Path(out), steps=3, batch=2), dp.shard(stream(batch=2)), log=lambda m: None, dp=dp)
    tr.run()
    q.put((rank, {k: v.numpy() for k, v in params(tr).items()}, [h["loss"] for h in tr.history]))
    dp.close()


def test_data_parallel_equals_joint_batch(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_dp_rank, args=(r, 2, port, str(tmp_path / "dp"), q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, (w, loss)) for r, w, loss in (q.get(timeout=180) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    def joint() -> Iterator[torch.Tensor]:
        s = stream(batch=2)
        while True:
            yield torch.cat([next(s), next(s)])

    single = Trainer(target(), tcfg(tmp_path / "one", steps=3, batch=4), joint(), log=lambda m: None)
    single.run()
    want = params(single)
    for r in range(2):
        w, losses = got[r]
        for k, v in want.items():
            assert torch.allclose(torch.from_numpy(w[k]), v, atol=1e-6, rtol=1e-5), (r, k)
        assert losses == pytest.approx([h["loss"] for h in single.history], rel=1e-5)
    assert (tmp_path / "dp" / "state.pt").is_file()  # only the main rank writes


def test_data_parallel_shards_stream() -> None:
    batches = list(range(10))
    assert list(DataParallel(1, 3).shard(batches)) == [1, 4, 7]
    with pytest.raises(ValueError, match="rank"):
        DataParallel(2, 2)


def test_self_distill_prompts_never_repeat(tmp_path: Path) -> None:
    path, _ = build(tmp_path)
    corpus = Corpus(path)
    allp = pick_prompts(corpus, 100, 10_000, seed=3)
    assert len(allp) >= 4
    head, tail = pick_prompts(corpus, 2, 10_000, seed=3), pick_prompts(corpus, 100, 10_000, seed=3, skip=2)
    assert head + tail == allp


# ---- the CLI, one process and under torchrun ----

class ModTokenizer:
    """Byte-level fake tokenizer folded into the tiny models' 96-id vocabulary."""

    def __init__(self) -> None:
        from test_corpus import ByteTokenizer

        self.inner = ByteTokenizer(vocab_size=ECFG.model.cfg.vocab_size)
        self.vocab_size, self.eos_ids = self.inner.vocab_size, self.inner.eos_ids
        self.special_ids, self.fingerprint = self.inner.special_ids, "mod-96"

    def _fold(self, ids: list[int]) -> list[int]:
        return [i if i < 3 else 3 + i % (self.vocab_size - 3) for i in ids]

    def encode(self, text: str) -> list[int]:
        return self._fold(self.inner.encode(text))

    def chat_ids(self, text: str) -> list[int]:
        return self._fold(self.inner.chat_ids(text))

    def conversation_ids(self, messages: list[dict]) -> list[int]:
        return self._fold(self.inner.conversation_ids(messages))


TRAIN_ARGS = ["--model", "random:tiny-llama", "--stages", "2", "--seq-len", "16", "--batch", "2",
              "--steps", "4", "--save-every", "2", "--threads", "1", "--autocast", "float32"]


def test_cli_self_distills_trains_and_resumes(tmp_path: Path, capsys) -> None:
    from spd_engine.tools.cli import main

    corpus_dir, _ = build(tmp_path, tok=ModTokenizer())
    out = tmp_path / "run"
    wsd = ["--schedule", "wsd", "--decay-frac", "0.25", "--fill-weights", "1,1"]  # extendable: decays from step 3
    rc = main(["train", *TRAIN_ARGS, *wsd, "--corpus", str(corpus_dir), "--out", str(out),
               "--self-distill", "5", "--gen-tokens", "6", "--gen-batch", "2"])
    assert rc == 0 and capsys.readouterr().out.strip() == f"{out}/pdm"
    gen = [s for s in Corpus(corpus_dir).manifest["sources"] if s["name"] == "self-distilled"]
    assert gen and gen[0]["samples"] == 5
    assert json_steps(out) == [1, 2, 3, 4]
    rc = main(["train", *TRAIN_ARGS, *wsd, "--steps", "6", "--corpus", str(corpus_dir), "--out", str(out),
               "--self-distill", "5"])  # the same answers are not generated again; back to step 3, on to 6
    assert rc == 0 and json_steps(out) == [1, 2, 3, 4, 5, 6]
    assert sum(s["samples"] for s in Corpus(corpus_dir).manifest["sources"] if s["name"] == "self-distilled") == 5
    assert main(["eval", "--model", "random:tiny-llama", "--stages", "2", "--spec", f"{out}/pdm", "--limit", "1",
                 "--max-new-tokens", "4", "--capacity", "256", "--data-dir", str(tmp_path / "eval"),
                 "--datasets", "mt_bench"]) == 0


def json_steps(out: Path) -> list[int]:
    import json

    return [h["step"] for h in json.loads((out / "history.json").read_text())]


@pytest.mark.multiproc
def test_cli_under_torchrun_two_ranks(tmp_path: Path) -> None:
    import subprocess
    import sys

    corpus_dir, _ = build(tmp_path, tok=ModTokenizer())
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           spd_script(), "train", *TRAIN_ARGS, "--corpus", str(corpus_dir), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(f"{out}/pdm") == 1  # the main rank reports; both trained
    hist = json_steps(out)
    assert hist == [1, 2, 3, 4]
    import json

    tokens = [h["tokens"] for h in json.loads((out / "history.json").read_text())]
    assert tokens == [2 * 2 * 16 * k for k in range(1, 5)]  # two ranks x batch 2 x 16 tokens per step
