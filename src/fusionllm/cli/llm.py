"""`fusionllm tokenizer train`, `fusionllm data prepare` and `fusionllm export`: a language model's
data in (a BPE tokenizer, tokenised shards) and its weights out (a Hugging Face directory)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from fusionllm.cli.common import console, user_errors
from fusionllm.core.errors import FusionError

tokenizer_app = typer.Typer(no_args_is_help=True, help="Tokenizers: train a byte-level BPE on your corpus.")
data_app = typer.Typer(no_args_is_help=True, help="Data: tokenise a corpus once into memory-mapped shards.")

SpecOpt = Annotated[str | None, typer.Option("--data", help="Text files, directories, globs (comma list), .jsonl, .parquet or a datasets save_to_disk directory; default: the embedded corpus.")]


@tokenizer_app.command("train")
@user_errors
def tokenizer_train(
    out: Annotated[Path, typer.Option("--out", help="Write the tokenizer.json here.")],
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="Tokens in the vocabulary (256 bytes, <|endoftext|> and the merges).")] = 8192,
    data: SpecOpt = None,
    field: Annotated[str, typer.Option("--field", help="The text field of JSON Lines / the text column of Parquet and datasets.")] = "text",
    max_bytes: Annotated[int, typer.Option("--max-bytes", help="Train on at most this many bytes of text.")] = 64 << 20,
) -> None:
    """Train a byte-level BPE (GPT-2's scheme) on --data; the file loads with --tokenizer."""
    from fusionllm.data.bpe import train_bpe
    from fusionllm.data.corpus import load_corpus
    from fusionllm.data.documents import documents

    def texts():  # noqa: ANN202
        if data is None:
            from fusionllm.data.bpe import corpus_texts

            yield from corpus_texts(load_corpus(None, max_bytes=max_bytes).tokens)
            return
        seen = 0
        for doc in documents(data, field):
            yield doc
            seen += len(doc)
            if seen >= max_bytes:
                return

    tok = train_bpe(texts(), vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(out)
    console.print(f"tokenizer: {tok.vocab_size} tokens -> {out} (sha256 {tok.digest[:12]})", highlight=False)


@data_app.command("prepare")
@user_errors
def data_prepare(
    out: Annotated[Path, typer.Option("--out", help="An empty (or new) directory for the shards and manifest.json.")],
    data: SpecOpt = None,
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="bytes (default), a tokenizer.json or a directory holding one.")] = None,
    field: Annotated[str, typer.Option("--field", help="The text field of JSON Lines / the text column of Parquet and datasets.")] = "text",
    val_fraction: Annotated[float, typer.Option("--val-fraction", help="The last fraction of the tokens, held out for validation.")] = 0.1,
    shard_tokens: Annotated[int, typer.Option("--shard-tokens", min=1024, help="Tokens per shard file.")] = 1 << 28,
) -> None:
    """Tokenise --data once; train with --data OUT (each worker memory-maps the shards)."""
    from fusionllm.data.corpus import _stdlib_files
    from fusionllm.data.prepare import prepare

    source = data if data is not None else ",".join(_stdlib_files())

    def progress(p: dict) -> None:
        mb = p["bytes"] / 1e6
        console.print(f"{'done' if p.get('done') else 'prepare'}: {p['documents']:,} documents, {mb:,.1f} MB, {p['tokens']:,} tokens, "
                      f"{mb / max(p['seconds'], 1e-9):.1f} MB/s", highlight=False)

    m = prepare(tokenizer, source, out, field=field, val_fraction=val_fraction, shard_tokens=shard_tokens, progress=progress)
    console.print(f"{out}: {len(m['shards'])} shard(s) of {m['dtype']}, {m['split']:,} training and {m['tokens'] - m['split']:,} validation tokens",
                  highlight=False)


@user_errors
def export(
    checkpoint_dir: Annotated[Path, typer.Argument(help="A run's --checkpoint-dir (its newest complete checkpoint) or one step-N directory.")],
    hf: Annotated[Path, typer.Option("--hf", help="Write a Hugging Face checkpoint directory here (config.json, model.safetensors, tokenizer).")],
) -> None:
    """Write a run's checkpoint as a Hugging Face directory (AutoModelForCausalLM.from_pretrained reads it)."""
    from safetensors.torch import load_file

    from fusionllm.core.checkpoints import latest_checkpoint
    from fusionllm.models.gpt import GPTConfig
    from fusionllm.models.hf import export as write_hf
    from fusionllm.models.llama import LlamaConfig

    step = checkpoint_dir if (checkpoint_dir / "state.json").is_file() else latest_checkpoint(checkpoint_dir)
    if step is None:
        raise FusionError(f"{checkpoint_dir}: no complete checkpoint (a step-N directory with state.json); train with --checkpoint-dir")
    state = json.loads((step / "state.json").read_text())
    if state.get("train", {}).get("task", "lm") != "lm":
        raise FusionError(f"{step}: a checkpoint of task {state['train']['task']!r}; export --hf writes language models")
    graph = json.loads((step / "graph.json").read_text())
    kinds = [(str(n.get("kind", "")), n.get("config", {})) for n in graph.get("nodes", [])]
    blocks = [c for k, c in kinds if k.endswith("fusionllm.models.gpt.Block")]
    layers = [c for k, c in kinds if k.endswith("fusionllm.models.llama.DecoderLayer")]
    if blocks:
        config = GPTConfig(**{**blocks[0], "n_layer": len(blocks)})
    elif layers:
        config = LlamaConfig(**{**layers[0], "num_hidden_layers": len(layers)})
    else:
        raise FusionError(f"{step}: the model is neither this project's GPT nor its Llama (no gpt.Block or llama.DecoderLayer ops); "
                          "export --hf writes those two")
    params = {}
    for shard in sorted(step.glob("stage-*.safetensors")):
        params.update({k.removeprefix("param/"): v for k, v in load_file(str(shard)).items() if k.startswith("param/")})
    tokenizer = _run_tokenizer(state.get("train", {}))
    eos = None
    if tokenizer:
        from fusionllm.data.bpe import load_tokenizer

        eos = load_tokenizer(tokenizer).eos_id
    out = write_hf(params, config, hf, tokenizer=tokenizer, eos_id=eos)
    console.print(f"{step} -> {out} ({type(config).__name__.removesuffix('Config')}, vocabulary {config.vocab_size}"
                  f"{', tokenizer ' + tokenizer if tokenizer else ', no tokenizer: the run used bytes'})", highlight=False)


def _run_tokenizer(train: dict) -> str | None:
    """The tokenizer.json the run trained with, if any (its own, the checkpoint's or the shards')."""
    from fusionllm.data.shards import is_prepared, open_prepared
    from fusionllm.models.spec import lm_tokenizer

    tok = lm_tokenizer(train.get("tokenizer"), train.get("init_from"))
    if tok is None and is_prepared(train.get("data")):
        spec = open_prepared(train["data"]).tokenizer_spec()
        tok = None if spec == "bytes" else spec
    if tok is None or tok == "bytes":
        return None
    path = Path(tok) / "tokenizer.json" if Path(tok).is_dir() else Path(tok)
    if not path.is_file():
        console.print(f"[yellow]warning: the run's tokenizer {tok} is gone; exported without one[/yellow]")
        return None
    return str(path)
