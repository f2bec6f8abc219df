"""A model's OpGraph: `fusionllm models`, `trace` and `verify` (the split run against autograd)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from fusionllm.cli.common import console, user_errors
from fusionllm.cli.options import DataOpt, ImageSizeOpt, ModelOpt, SeedOpt, TaskOpt


@user_errors
def verify(
    model: ModelOpt = "gpt-mini",
    parts: Annotated[int, typer.Option(help="Number of random stages.")] = 4,
    seed: SeedOpt = 0,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 2,
    seq_len: Annotated[int, typer.Option("--seq-len")] = 32,
    device: Annotated[str, typer.Option(help="cpu or cuda:N (reference and stages both run there).")] = "cpu",
    task: TaskOpt = "lm",
    data: DataOpt = None,
    image_size: ImageSizeOpt = 32,
) -> None:
    """Split a model's OpGraph into random stages, run it through the executor, compare with autograd
    (a task's model in training mode, its buffers included)."""
    from fusionllm.runtime.reference.verify import TOLERANCE, verify_spec, verify_task

    def say(msg: str) -> None:
        console.print(f"[dim]{msg}[/dim]")

    if task == "lm":
        report = verify_spec(model, parts=parts, seed=seed, batch_size=batch_size, seq_len=seq_len, device=device, progress=say)
        what = "loss and every parameter gradient"
    else:
        from fusionllm.models.task import build_task_model, load_task, model_label

        if task == "vision" and model == "gpt-mini":
            model = "resnet18"
        made = load_task(task, {"model": model, "data": data, "seed": seed, "batch_size": batch_size, "seq_len": seq_len, "image_size": image_size})
        report = verify_task(made, build_task_model(made, seed), parts=parts, seed=seed, device=device, progress=say)
        if task != "vision":
            model = model_label(made)
        what = "loss, every parameter gradient and every floating-point buffer, in training mode"
    worst = sorted(report.errors.items(), key=lambda kv: -kv[1])[:5]
    print(f"{'model' if task == 'lm' else 'task=' + task + ' model'}={model} ops={report.nodes} stages={report.stages} wire_bytes={report.bytes_on_wire}")
    print(f"loss reference={report.loss_reference:.6f} split={report.loss_split:.6f}")
    print(f"compared {len(report.errors)} tensors ({what}); largest errors:")
    for name, err in worst:
        print(f"  {name}: {err:.3e}")
    for note in report.notes:
        print(f"note: {note}")
    print("PASS" if report.ok else f"FAIL: above tolerance {TOLERANCE:g}")
    print(f"max_rel_err={report.max_rel_err:.3e}")
    if not report.ok:
        raise typer.Exit(1)


@user_errors
def trace_cmd(
    model: ModelOpt = "gpt-micro",
    batch_size: Annotated[int, typer.Option("--batch-size")] = 1,
    seq_len: Annotated[int, typer.Option("--seq-len")] = 64,
    out: Annotated[Path | None, typer.Option(help="Write the OpGraph JSON here.")] = None,
    granularity: Annotated[str, typer.Option(help="layer (blocks are ops) or fine (torch.nn layers are ops).")] = "layer",
    leaf: Annotated[list[str] | None, typer.Option(help="Make this module (qualified name or class) one op; repeatable.")] = None,
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="Vocabulary (256: bytes; 50257: GPT-2).")] = 256,
) -> None:
    """Trace a model on the meta device (no weights allocated) and summarise its OpGraph."""
    from fusionllm.models.spec import build_model
    from fusionllm.runtime.backends.model_graph import trace_lm

    started = time.perf_counter()
    net = build_model(model, vocab_size, device="meta")
    graph = trace_lm(net, batch_size, seq_len, vocab_size=vocab_size, spec=model, granularity=granularity, leaf_modules=leaf or ())
    seconds = time.perf_counter() - started
    kinds: dict[str, int] = {}
    for n in graph.compute_nodes:
        kinds[n.kind] = kinds.get(n.kind, 0) + 1
    print(f"model={model} ops={len(graph.compute_nodes)} params={graph.num_params()} seconds={seconds:.2f}")
    for kind, count in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {count:5d}  {kind}")
    if out:
        out.write_text(graph.to_json(indent=1))
        print(f"wrote {out}")


@user_errors
def models() -> None:
    """List the built-in models with their sizes."""
    from fusionllm.models.gpt import CONFIGS
    from fusionllm.models.llama import CONFIGS as LLAMA
    from fusionllm.models.spec import build_model

    print(f"{'name':12s} {'params (bytes, V=256)':>22s} {'params (GPT-2 V=50257)':>23s}  shape")
    for name, cfg in {**CONFIGS, **LLAMA}.items():
        sizes = [sum(p.numel() for p in build_model(name, v, device="meta").parameters()) for v in (256, 50257)]
        shape = " ".join(f"{k}={v}" for k, v in cfg.items())
        print(f"{name:12s} {sizes[0] / 1e6:21.2f}M {sizes[1] / 1e6:22.2f}M  {shape}")
