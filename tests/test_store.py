"""Shards: the storage formula, fp8 error bounds, the reader contract, checksums, teacher_logprobs.

The tensors here are random but shaped like capture output; tests/test_extract.py checks the
same path end to end with a real target."""
from __future__ import annotations

import pickle

import pytest
import torch

from drafter.core.rundir import Run
from drafter.features import store
from drafter.features.capture import Head

HT, L, VD = 48, 3, 300
OPTIONS = [("bf16", "hidden"), ("bf16", "topk"), ("fp8", "hidden"), ("fp8", "topk")]


def fake_capture(lengths, teacher, k=8, seed=0) -> tuple[dict, torch.Tensor]:
    """What Capture.run returns for samples of these lengths (+ their loss masks)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    offsets = torch.tensor([0] + lengths).cumsum(0)
    # hidden states with the spread real ones have: a few large channels, per-token scales
    aux = torch.randn(n, L, HT, generator=g) * torch.logspace(-1, 2, n)[:, None, None]
    aux[:, :, 0] *= 30
    flat = {"input_ids": torch.randint(0, 1000, (n,), generator=g), "offsets": offsets,
            "aux": aux.to(torch.bfloat16), "in_vocab": torch.rand(n, generator=g) > 0.2}
    if teacher == "hidden":
        flat["teacher_hidden"] = torch.randn(n, HT, generator=g).to(torch.bfloat16)
    else:
        lp = torch.log_softmax(torch.randn(n, VD, generator=g) * 3, -1)
        v, i = lp.topk(k, -1)
        flat["teacher_topk_ids"], flat["teacher_topk_logp"] = i, v.half().float()
    return flat, (torch.rand(n, generator=g) > 0.5).long()


def write_split(run: Run, split: str, batches, aux_dtype: str, info: dict | None = None):
    info = info or {"layer_ids": [1, 2, 3], "hidden_size": HT, "aux_dtype": aux_dtype}
    writer = store.ShardWriter(info)
    for i, parts in enumerate(batches):
        enc = [store.to_host(store.encode(f, m, aux_dtype, VD)) for f, m in parts]
        n = sum(len(t["offsets"]) - 1 for t, _ in enc)
        writer.submit(run.shard(split, i), enc, [f"{split}:{i}:{j}" for j in range(n)])
    entries = writer.close()
    head = Head(torch.randn(VD, HT).to(torch.bfloat16), 1.0, None)
    sha = store.save_head(run.extract_head(), head, info)
    return store.write_index(run.shard_index(split), info,
                             [entries[run.shard(split, i)] for i in range(len(batches))], sha)


@pytest.mark.parametrize("aux_dtype,teacher", OPTIONS)
def test_reader_hands_back_the_contract(tmp_path, aux_dtype, teacher):
    run = Run(tmp_path)
    # shard 0 is written from two forwards (offsets rebased), shard 1 from one
    lengths = [[[7, 5], [3]], [[11, 2, 4]]]
    src = [[fake_capture(ls, teacher, seed=10 * i + j) for j, ls in enumerate(shard)]
           for i, shard in enumerate(lengths)]
    index = write_split(run, "train", src, aux_dtype)
    r = store.Reader(run, "train", verify=True)
    assert len(r) == 6 and r.lengths == [7, 5, 3, 11, 2, 4] and r.num_tokens == 32
    assert index["num_tokens"] == 32 and r.ids[3] == "train:1:0"
    assert [e["lengths"] for e in index["shards"]] == [[7, 5, 3], [11, 2, 4]]
    i = 0
    for parts in src:
        for flat, mask in parts:
            off = flat["offsets"].tolist()
            for a, b in zip(off[:-1], off[1:]):
                s = r[i]
                i += 1
                assert s["input_ids"].dtype == torch.int64
                assert torch.equal(s["input_ids"], flat["input_ids"][a:b])
                assert s["loss_mask"].dtype == torch.int64
                assert torch.equal(s["loss_mask"], mask[a:b])
                assert torch.equal(s["in_vocab"], flat["in_vocab"][a:b])
                assert s["aux"].dtype == torch.bfloat16 and s["aux"].shape == (b - a, L, HT)
                ref = flat["aux"][a:b].float()
                if aux_dtype == "bf16":
                    assert torch.equal(s["aux"].float(), ref)
                else:  # e4m3: 3 mantissa bits -> |error| <= 2^-4 |x| (+ bf16 output rounding)
                    err = (s["aux"].float() - ref).abs()
                    assert (err <= ref.abs() * 2 ** -4 * 1.02 + ref.abs().amax(-1,
                            keepdim=True) * 2 ** -9 + 1e-30).all()
                    assert err.max() > 0  # it really is fp8
                if teacher == "hidden":
                    assert set(s) == {"input_ids", "loss_mask", "aux", "in_vocab",
                                      "teacher_hidden"}
                    assert torch.equal(s["teacher_hidden"], flat["teacher_hidden"][a:b])
                else:
                    assert set(s) == {"input_ids", "loss_mask", "aux", "in_vocab",
                                      "teacher_topk_ids", "teacher_topk_logp"}
                    assert s["teacher_topk_ids"].dtype == torch.int64
                    assert s["teacher_topk_logp"].dtype == torch.float32
                    assert torch.equal(s["teacher_topk_ids"], flat["teacher_topk_ids"][a:b])
                    assert torch.equal(s["teacher_topk_logp"], flat["teacher_topk_logp"][a:b])
    # DataLoader workers get a pickled reader: open files are not carried, reads still work
    r2 = pickle.loads(pickle.dumps(r))
    assert torch.equal(r2[4]["aux"], r[4]["aux"])


@pytest.mark.parametrize("aux_dtype,teacher", OPTIONS)
def test_offline_batches_carry_the_stored_dtypes_and_widen_to_the_decoded_batch(tmp_path,
                                                                               aux_dtype, teacher):
    """Source.offline hands collate the samples as stored (fp8 aux and its scales, int16 ids,
    float16 log-probs: half the bytes of the decoded ones, and none of the conversions that
    took most of a build); device_batch widens them where the batch lands. What
    the model gets is the decoded samples' batch, to the bit."""
    from types import SimpleNamespace

    from drafter.train import batches

    run = Run(tmp_path)
    lengths = [[[7, 5], [3, 9]], [[11, 2, 4]]]
    write_split(run, "train", [[fake_capture(ls, teacher, seed=10 * i + j)
                                for j, ls in enumerate(shard)] for i, shard in enumerate(lengths)],
                aux_dtype)
    r = store.Reader(run, "train")
    stored = batches.Source.offline(r)
    decoded = batches.Source(r.ids, r.lengths, lambda idx: [r[j] for j in idx])
    tc, emb = SimpleNamespace(method="eagle3", ttt_steps=3, ttt_decay=0.8), torch.randn(1000, 16)
    rows = [[0, 1, 2], [3, 6], [5, 4]]                        # padding in rows 1 and 2
    a = batches.host_batch(stored, rows, 3, 24, tc, emb)
    b = batches.host_batch(decoded, rows, 3, 24, tc, emb)
    if aux_dtype == "fp8":
        assert a["aux"].dtype == torch.float8_e4m3fn and a["aux_scale"].shape == (3, 24, L)
    else:
        assert a["aux"].dtype == torch.bfloat16 and "aux_scale" not in a
    if teacher == "topk":
        assert a["teacher_topk_ids"].dtype == torch.int16
        assert a["teacher_topk_logp"].dtype == torch.float16
        assert b["teacher_topk_logp"].dtype == torch.float32
    nbytes = lambda hb: sum(v.nbytes for v in hb.values() if torch.is_tensor(v))  # noqa: E731
    assert nbytes(a) < nbytes(b) or (aux_dtype, teacher) == ("bf16", "hidden")
    head = Head(torch.randn(VD, HT), 1.0, None)
    for fused in (False, True):
        x = batches.device_batch(a, torch.device("cpu"), head, fused)
        y = batches.device_batch(b, torch.device("cpu"), head, fused)
        assert x.keys() == y.keys() and "aux_scale" not in x
        for k in x:
            if k == "teacher":
                assert x[k].keys() == y[k].keys()
                for t in x[k]:
                    assert x[k][t].dtype == y[k][t].dtype and torch.equal(x[k][t], y[k][t]), t
            elif torch.is_tensor(x[k]):
                assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
            else:
                assert x[k] == y[k], k


@pytest.mark.parametrize("aux_dtype,teacher", OPTIONS)
def test_bytes_per_token_formula_matches_the_files(tmp_path, aux_dtype, teacher):
    run = Run(tmp_path)
    flat, mask = fake_capture([400, 300, 324], teacher)
    index = write_split(run, "train", [[(flat, mask)]], aux_dtype)
    formula = store.bytes_per_token(HT, L, aux_dtype, teacher, topk=8, draft_vocab_size=VD)
    actual = index["bytes"] / index["num_tokens"]
    assert formula <= actual <= formula * 1.02 + 2  # + header, offsets, ids
    assert index["bytes_per_token"] == round(actual, 2)


def test_formula_against_the_reference():
    ref = store.reference_bytes_per_token(7168)
    assert ref == 8 * 7168 + 16
    assert store.bytes_per_token(7168) == 8 * 7168 + 6          # bf16 + hidden: the reference
    small = store.bytes_per_token(7168, aux_dtype="fp8", teacher="topk", topk=64,
                                  draft_vocab_size=32000)
    assert small == 6 + 3 * 7168 + 12 + 64 * 4
    assert small / ref < 0.4
    # ids need 4 bytes once the draft vocab exceeds int16
    assert store.bytes_per_token(64, teacher="topk", topk=10, draft_vocab_size=40000) \
        - store.bytes_per_token(64, teacher="topk", topk=10, draft_vocab_size=32000) == 20


def test_fp8_zero_and_huge_tokens():
    x = torch.zeros(2, 3, 16)
    x[1, 2] = torch.linspace(-3e4, 3e4, 16)
    q, s = store.quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3) and s.dtype == torch.float32
    y = store.dequantize_fp8(q, s)
    assert torch.equal(y[0], torch.zeros(3, 16, dtype=torch.bfloat16))
    assert torch.isfinite(y).all()
    assert y[1, 2].float().abs().max() == pytest.approx(3e4, rel=1e-2)


def test_corrupt_shard_is_detected_with_and_without_the_index(tmp_path):
    run = Run(tmp_path)
    src = [[fake_capture([5, 6], "topk", seed=s)] for s in range(2)]
    index = write_split(run, "train", src, "fp8")
    p = run.shard("train", 1)
    entry = index["shards"][1]
    assert store.check_shard(p, entry["ids"], entry) == entry
    assert store.check_shard(p, entry["ids"]) == entry          # self-verification
    assert store.check_shard(p, ["other"]) is None              # not the planned samples
    blob = bytearray(p.read_bytes())
    blob[-100] ^= 0xFF                                          # one bit pattern in the data
    p.write_bytes(bytes(blob))
    assert store.check_shard(p, entry["ids"], entry) is None
    assert store.check_shard(p, entry["ids"]) is None            # content hash catches it too
    r = store.Reader(run, "train")
    assert r.verify() == [p]
    with pytest.raises(store.ShardError, match="corrupt shards"):
        store.Reader(run, "train", verify=True)
    p.write_bytes(b"garbage")
    assert store.check_shard(p, entry["ids"]) is None


def test_index_errors_name_the_step(tmp_path):
    run = Run(tmp_path)
    with pytest.raises(FileNotFoundError, match="drafter extract"):
        store.Reader(run, "val")
    run.shards("val").mkdir(parents=True)
    run.shard_index("val").write_text('{"format": "drafter-hidden-states", "version": 0}')
    with pytest.raises(store.ShardError, match="--force"):
        store.Reader(run, "val")


def test_teacher_logprobs_hidden_and_topk():
    torch.manual_seed(0)
    T, k = 6, 16
    w = torch.randn(VD, HT)
    h = torch.randn(T, HT)
    head = Head(w, scale=0.5, softcap=10.0)
    lp = store.teacher_logprobs({"teacher_hidden": h}, head)
    ref = torch.log_softmax(torch.tanh(h @ w.T * 0.5 / 10.0) * 10.0, -1)
    assert lp.shape == (T, VD) and torch.allclose(lp, ref, atol=1e-5)
    plain = store.teacher_logprobs({"teacher_hidden": h}, w)   # a bare [Vd, Ht] tensor
    assert torch.allclose(plain, torch.log_softmax(h @ w.T, -1), atol=1e-5)

    v, i = ref.topk(k, -1)
    dense = store.teacher_logprobs({"teacher_topk_ids": i, "teacher_topk_logp": v}, head)
    assert dense.shape == (T, VD)
    assert torch.allclose(dense.gather(1, i), v)                       # exact top-k values
    assert torch.allclose(dense.logsumexp(-1), torch.zeros(T), atol=1e-5)   # a distribution
    assert torch.equal(dense.argmax(-1), ref.argmax(-1))
    rest = dense.scatter(1, i, float("-inf")).amax(-1)
    assert (rest < v[:, -1]).all()                                    # tail below the top-k
    # batched [B, T, k], an int Vd, and a top-k that holds all the mass (tail floored, finite)
    b = store.teacher_logprobs({"teacher_topk_ids": i[None].repeat(2, 1, 1),
                                "teacher_topk_logp": v[None].repeat(2, 1, 1)}, VD)
    assert b.shape == (2, T, VD) and torch.equal(b[1], dense)
    full = store.teacher_logprobs({"teacher_topk_ids": torch.tensor([[0, 1]]),
                                   "teacher_topk_logp": torch.tensor([[0.0, -50.0]])}, 4)
    assert torch.isfinite(full).all() and full[0, 0] == 0.0
    with pytest.raises(store.ShardError):
        store.teacher_logprobs({"teacher_hidden": h}, VD)


def test_head_file_roundtrip(tmp_path):
    run = Run(tmp_path)
    run.step_dir("extract").mkdir(parents=True)
    head = Head(torch.randn(VD, HT).to(torch.bfloat16), 0.25, 30.0)
    store.save_head(run.extract_head(), head, {})
    back = store.load_head(run.extract_head())
    assert torch.equal(back.weight, head.weight) and back.scale == 0.25 and back.softcap == 30.0


def test_equal_shards_are_equal_files_across_processes(tmp_path):
    """safetensors writes metadata keys in a per-process random order; the shard format keeps
    one key so that a rerun (resume, another rank) writes byte-identical files."""
    import subprocess
    import sys

    code = ("import sys, torch; from pathlib import Path; from drafter.features import store; "
            "t = {'offsets': torch.tensor([0, 3]), 'aux': torch.arange(12.).reshape(3, 4)}; "
            "store.write_shard(Path(sys.argv[1]), t, {'a': 1, 'b': [2], 'c': 'x'}, ['s0'])")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "a")], check=True, timeout=120)
    t = {"offsets": torch.tensor([0, 3]), "aux": torch.arange(12.).reshape(3, 4)}
    store.write_shard(tmp_path / "b", t, {"c": "x", "b": [2], "a": 1}, ["s0"])
    assert store.file_sha256(tmp_path / "a") == store.file_sha256(tmp_path / "b")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_to_host_copies_on_a_side_stream(tmp_path):
    """On a GPU: encoded batches travel to pinned host memory asynchronously; the writer waits
    for them and the shard equals one written from a synchronous copy."""
    flat, mask = fake_capture([9, 4], "topk")
    # as Capture.run gives them: the features on the GPU, the offsets on the host
    gpu_flat = {k: v if k == "offsets" else v.cuda() for k, v in flat.items()}
    parts = [store.to_host(store.encode(gpu_flat, mask.cuda(), "fp8", VD))]
    assert parts[0][1] is not None and parts[0][0]["aux"].is_pinned()
    w = store.ShardWriter({})
    w.submit(tmp_path / "a.safetensors", parts, ["x", "y"])
    # the reference: the same GPU encoding copied synchronously (CPU and CUDA may round fp8 and
    # order top-k ties differently, which is not what this test is about)
    sync = {k: v.cpu() for k, v in store.encode(gpu_flat, mask.cuda(), "fp8", VD).items()}
    w.submit(tmp_path / "b.safetensors", [(sync, None)], ["x", "y"])
    e = w.close()
    assert e[tmp_path / "a.safetensors"]["sha256"] == e[tmp_path / "b.safetensors"]["sha256"]
