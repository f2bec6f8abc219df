"""An LM trained in one plain PyTorch process, as the cut and codec benchmarks watch it.

``cut_structure.py``, ``reduce_rows.py``, ``dither_grads.py`` and ``codecs_one_process.py`` train
the same way (batch 8 x 128 in 4 micro-batches of 2 sequences, AdamW at lr 3e-3, ``warmup`` steps
(10; ``codecs_one_process.py``: 20, as the testbed runs) then a cosine over ``steps``, gradient
clipping, one thread); this is that loop's setup and its three parts, so each script keeps only
what it records.
"""

from __future__ import annotations

from typing import Any

MICRO_BATCHES, ROWS = 4, 2  # 4 micro-batches of 2 sequences of 128 tokens


class OneProcessLM:
    """``model`` (a built-in spec) with its data, optimiser and schedule; torch is imported here."""

    def __init__(self, model: str, steps: int, seed: int, warmup: int = 10) -> None:
        import torch

        from fusionllm.core.config import TrainConfig
        from fusionllm.data import Batcher
        from fusionllm.data.lm_tokens import load_lm_tokens
        from fusionllm.models.loss import lm_loss
        from fusionllm.models.spec import build_lm, lm_tokenizer
        from fusionllm.runtime.stage.optim import make_adamw

        torch.set_num_threads(1)
        self.torch, self.lm_loss = torch, lm_loss
        self.cfg = TrainConfig(model=model, steps=steps, batch_size=MICRO_BATCHES * ROWS, seq_len=128, lr=3e-3, seed=seed)
        tokens = load_lm_tokens(self.cfg.data, lm_tokenizer(self.cfg.tokenizer, self.cfg.init_from), 0.1)
        self.tokens, self.warmup = tokens, warmup
        self.batches = Batcher(tokens.train, MICRO_BATCHES * ROWS, 128, seed)
        self.model = build_lm(model, tokens.vocab_size, seed=seed)
        self.optimizer = make_adamw(self.model.named_parameters(), self.cfg.lr, self.cfg.weight_decay)

    def start(self, step: int) -> tuple[Any, Any]:
        """The step's learning rate set, gradients cleared; its batch (inputs, targets)."""
        from fusionllm.core.config import lr_at

        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, lr=self.cfg.lr, steps=self.cfg.steps, warmup=self.warmup)
        x, y = self.batches.get(step)
        self.optimizer.zero_grad(set_to_none=True)
        return x, y

    def micro_batch_loss(self, x: Any, y: Any, mb: int) -> Any:
        """Micro-batch ``mb``'s mean loss (a graph to backpropagate)."""
        rows = slice(mb * ROWS, (mb + 1) * ROWS)
        return self.lm_loss(self.model(x[rows]).float(), y[rows])

    def backward(self, x: Any, y: Any) -> None:
        """The step's gradients: every micro-batch's loss over their number, backpropagated."""
        for mb in range(MICRO_BATCHES):
            (self.micro_batch_loss(x, y, mb) / MICRO_BATCHES).backward()

    def finish(self) -> None:
        """Clip and apply the step's gradients."""
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
