"""Hugging Face GPT-2 checkpoints in (`--init-from`) and out (`fusionllm export --hf`), against
`transformers` itself, and the README's four commands end to end on files made here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import ConfigError
from fusionllm.core.metrics import read_metrics
from fusionllm.data.batching import Batcher
from fusionllm.data.lm_tokens import load_lm_tokens
from fusionllm.models.hf import export, from_pretrained
from fusionllm.runtime.reference.single import train_single

transformers = pytest.importorskip("transformers")
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "models", "train", "across", "slow", "links"]


def hf_gpt2(root: Path, vocab: int = 500, activation: str = "gelu_new", seed: int = 0, dropout: float = 0.0) -> Path:
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=3, n_head=2, activation_function=activation,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # biases and LayerNorm weights away from their init, so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith(("bias", "ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(root)
    return root


def hf_logits(directory: Path, x: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        return model(input_ids=x).logits


@pytest.mark.parametrize("activation", ["gelu_new", "gelu"])
def test_a_gpt2_checkpoint_loads_with_the_logits_of_transformers(tmp_path: Path, activation: str) -> None:
    d = hf_gpt2(tmp_path / "m", activation=activation)
    x = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(1))
    ours = from_pretrained(d).eval()
    with torch.no_grad():
        np.testing.assert_allclose(ours(x).numpy(), hf_logits(d, x).numpy(), rtol=1e-5, atol=1e-5)
    # and back out: export, reload in transformers, the same logits again
    export(dict(ours.named_parameters()), ours.config, tmp_path / "out")
    np.testing.assert_allclose(hf_logits(tmp_path / "out", x).numpy(), hf_logits(d, x).numpy(), rtol=1e-5, atol=1e-5)


def test_bad_checkpoints_are_named_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no readable config.json"):
        from_pretrained(tmp_path)
    d = hf_gpt2(tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(ConfigError, match="model_type 'mistral'; this fusionllm loads gpt2 and llama"):
        from_pretrained(d)
    (d / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ConfigError, match="config.json of a llama lacks hidden_size"):
        from_pretrained(d)
    (d / "config.json").write_text(json.dumps({**config, "n_layer": 4}))
    with pytest.raises(ConfigError, match=r"missing transformer\.h\.3\."):
        from_pretrained(d)
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="the tokenizer has 900 tokens"):
        from_pretrained(d, vocab_size=900)


def test_single_process_fine_tuning_starts_at_the_loss_transformers_computes(tmp_path: Path) -> None:
    d = hf_gpt2(tmp_path / "m", vocab=256)  # the byte tokenizer: 256 ids
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(9)) for i in range(400)))
    config = TrainConfig(steps=2, batch_size=4, seq_len=32, data=str(corpus), init_from=str(d), eval_every=0, warmup=0, lr=1e-3)
    result = train_single(config)
    x, y = Batcher(load_lm_tokens(str(corpus)).train, 4, 32, 0).get(0)
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(d))
        loss = hf(input_ids=torch.cat([x, y[:, -1:]], 1), labels=torch.cat([x, y[:, -1:]], 1)).loss
    assert result.losses[0] == pytest.approx(float(loss), rel=1e-5)


def _cli(*args: str, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "fusionllm", *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr + proc.stdout


@pytest.mark.slow
def test_the_readme_fine_tuning_walkthrough_end_to_end(tmp_path: Path) -> None:
    """tokenizer train -> data prepare -> train on local:3 from a transformers checkpoint -> export:
    the first step's loss is transformers' loss on that batch, and the exported model's logits are
    those of the trained weights, read back by AutoModelForCausalLM and AutoTokenizer."""
    rng = np.random.default_rng(0)
    (tmp_path / "corpus").mkdir()
    for i in range(3):
        (tmp_path / "corpus" / f"d{i}.txt").write_text("\n".join(" ".join(rng.choice(WORDS, 10)) for _ in range(300)))
    _cli("tokenizer", "train", "--vocab-size", "400", "--data", "corpus", "--out", "tok.json", cwd=tmp_path)
    _cli("data", "prepare", "--tokenizer", "tok.json", "--data", "corpus", "--out", "shards", cwd=tmp_path)
    d = hf_gpt2(tmp_path / "my-gpt2", vocab=400)
    _cli("train", "--cluster", "local:3", "--init-from", "my-gpt2", "--tokenizer", "tok.json", "--data", "shards", "--steps", "3",
         "--batch-size", "8", "--seq-len", "32", "--micro-batches", "2", "--eval-every", "0", "--checkpoint-dir", "ck",
         "--checkpoint-every", "3", "--metrics", "m.jsonl", "--run-dir", "run", cwd=tmp_path)
    out = _cli("export", "ck", "--hf", "finetuned", cwd=tmp_path)
    assert "tokenizer" in out
    first = next(r for r in read_metrics(tmp_path / "m.jsonl").steps if r["step"] == 0)
    x, y = Batcher(load_lm_tokens(str(tmp_path / "shards")).train, 8, 32, 0).get(0)
    with torch.no_grad():
        window = torch.cat([x, y[:, -1:]], 1)
        start = transformers.AutoModelForCausalLM.from_pretrained(str(d))(input_ids=window, labels=window).loss
    assert first["loss"] == pytest.approx(float(start), rel=1e-5)
    # the exported weights are the checkpoint's: fusionllm's GPT with them gives transformers' logits
    from safetensors.torch import load_file

    from fusionllm.core.checkpoints import latest_checkpoint

    step = latest_checkpoint(tmp_path / "ck")
    params = {k.removeprefix("param/"): v for s in sorted(step.glob("stage-*.safetensors")) for k, v in load_file(str(s)).items() if k.startswith("param/")}
    ours = from_pretrained(d).eval()
    ours.load_state_dict({**params, "lm_head.weight": params["wte.weight"]})
    with torch.no_grad():
        np.testing.assert_allclose(hf_logits(tmp_path / "finetuned", x).numpy(), ours(x).numpy(), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(ours(x), from_pretrained(d).eval()(x))  # and training moved them
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "finetuned"))
    assert tok.decode(tok("the lazy fox")["input_ids"]) == "the lazy fox"


def hf_llama(root: Path, *, tie: bool = False, vocab: int = 256) -> Path:
    """A Llama with grouped-query attention (4 query heads, 2 key/value heads), RoPE, RMSNorm, SwiGLU."""
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # the RMSNorm weights away from 1, so a norm left out shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(root)
    return root


@pytest.mark.parametrize("tie", [False, True])
def test_a_llama_checkpoint_loads_and_exports_with_the_logits_of_transformers(tmp_path: Path, tie: bool) -> None:
    d = hf_llama(tmp_path / "m", tie=tie)
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(2))
    ours = from_pretrained(d).eval()
    with torch.no_grad():
        np.testing.assert_allclose(ours(x).numpy(), hf_logits(d, x).numpy(), rtol=1e-5, atol=1e-5)
    export(dict(ours.named_parameters(remove_duplicate=False)), ours.config, tmp_path / "out")
    np.testing.assert_allclose(hf_logits(tmp_path / "out", x).numpy(), hf_logits(d, x).numpy(), rtol=1e-5, atol=1e-5)


def test_a_llama_trains_in_three_stages_as_in_one_process(tmp_path: Path) -> None:
    """Fails when a stage boundary loses a gradient of grouped-query attention or of the untied LM head."""
    from fusionllm.launch.inprocess import cluster_config, run_in_process

    d = hf_llama(tmp_path / "m")
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(9)) for i in range(400)))
    train = TrainConfig(steps=3, batch_size=4, seq_len=32, data=str(corpus), init_from=str(d), eval_every=3, eval_batches=1, warmup=0, lr=1e-3)
    single = train_single(train)
    dist, workers = run_in_process(train, cluster_config(3, micro_batches=1, eval_every=3, eval_batches=1))
    np.testing.assert_allclose(dist.losses, single.losses, rtol=1e-5)
    np.testing.assert_allclose([v for _, v in dist.val_losses], [v for _, v in single.val_losses], rtol=1e-5)
    reference = dict(single.model.named_parameters())
    seen = set()
    for w in workers:
        for key, value in w.runtime.state_tensors().items():
            if key.startswith("param/"):
                seen.add(key.removeprefix("param/"))
                np.testing.assert_allclose(value.numpy(), reference[key.removeprefix("param/")].detach().numpy(), rtol=1e-5, atol=1e-7)
    assert seen == set(reference)


def test_a_gpt2_with_dropout_trains_in_two_stages_as_in_one_process(tmp_path: Path) -> None:
    """GPT-2's own dropout (0.1, as Hugging Face ships it): the one-process reference draws the masks
    the split draws, micro-batch by micro-batch. Fails when the reference draws from torch's generator
    (the losses then differ by the whole effect of dropout)."""
    from fusionllm.launch.inprocess import cluster_config, run_in_process

    d = hf_gpt2(tmp_path / "m", dropout=0.1)
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(9)) for i in range(400)))
    train = TrainConfig(steps=3, batch_size=4, seq_len=32, data=str(corpus), init_from=str(d), eval_every=0, warmup=0, lr=1e-3)
    single = train_single(train, micro_batches=2)
    dist, _ = run_in_process(train, cluster_config(2, micro_batches=2))
    np.testing.assert_allclose(dist.losses, single.losses, rtol=1e-5)
    other = train_single(TrainConfig(**{**train.__dict__, "seed": 1}), micro_batches=2)
    assert not np.allclose(other.losses[1:], single.losses[1:], rtol=1e-4)  # the masks do depend on the seed


def test_each_stage_reads_only_its_own_tensors_from_the_checkpoint_files(tmp_path: Path) -> None:
    """What the coordinator sends a stage (read_selected over HFWeights) holds that stage's tensors
    alone, converted (GPT-2's Conv1D transposed) exactly as a whole load converts them."""
    from safetensors.torch import load

    from fusionllm.models.hf import HFWeights
    from fusionllm.transport.shards import read_selected, stage_keep

    d = hf_gpt2(tmp_path / "m")
    meta = from_pretrained(d, weights=False)
    assert all(p.is_meta for p in meta.parameters())
    blob = load(read_selected([HFWeights(meta, d)], stage_keep({"h.1.attn.c_attn.weight", "h.1.ln_1.bias", "wte.weight"})))
    assert set(blob) == {"param/h.1.attn.c_attn.weight", "param/h.1.ln_1.bias", "param/wte.weight"}
    whole = dict(from_pretrained(d).named_parameters())
    for key, value in blob.items():
        assert torch.equal(value, whole[key.removeprefix("param/")].detach())
