"""Distils an EAGLE-3 draft head from the MoE target (our own loop; SpecForge does not run
on our pins).

Data: for each sequence the target reads, its EAGLE-3 aux states (outputs of the layers in
``aux_layer_ids``) and its next-token distribution at every position, kept as the top
``soft_top_k`` tokens and probabilities. The draft learns to predict what the target would
output, not the text's next token: cross-entropy against the target's distribution
restricted to those tokens and to the draft vocabulary (soft labels carry far more signal
per token than the argmax alone, which matters with a few tens of thousands of tokens).

Training unrolls ``ttt_steps`` draft steps per position (test-time training, as EAGLE-3):
step 0 reads the target's aux state, step k >= 1 reads the draft's own output hidden state
of step k-1 for the same row, one position further, exactly as tree drafting does at
inference (SGLang drafts num_steps deep). Step k's row t attends to step 0's rows 0..t and to
its own earlier steps' row t; its loss weight is ``ttt_decay**k``.

Shape legend: B = sequences, T = rows, H = hidden size, A = aux layers, V = target vocab,
D = draft vocab, S = unrolled steps.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from sgl_ecospec.lab.testbed.recipe import DraftSpec
from sgl_ecospec.models import eagle3


@dataclass
class Sample:
    """One target-read sequence.

    tokens: int64 ``[T]``; aux: bfloat16 ``[T, A*H]`` (aux state g_t after token t);
    top_ids: int64 ``[T, k]`` and top_probs: float32 ``[T, k]``: the target's k most likely
    next tokens after token t, most likely first (``top_ids[:, 0]`` is its greedy token).
    """

    tokens: torch.Tensor
    aux: torch.Tensor
    top_ids: torch.Tensor
    top_probs: torch.Tensor

    @property
    def greedy(self) -> torch.Tensor:
        """int64 ``[T]``: the target's greedy token after each token."""
        return self.top_ids[:, 0]


def top_tokens(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., V]`` logits -> (ids int64 ``[..., k]``, probabilities float32 ``[..., k]``)."""
    probs, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return ids, probs


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    batch: int,
    aux_layer_ids: tuple[int, ...],
    soft_top_k: int = 1,
) -> list[Sample]:
    """Greedy target answers to chat-rendered prompts, with the states the draft learns from.

    Each returned sample is prompt + answer (up to and including eos, at most
    ``max_new_tokens``); its aux states and greedy tokens come from the same forwards that
    generated the answer (the prompt's from the prefill). Aux id a is the output of target
    layer a (transformers' ``hidden_states[a + 1]``), as SGLang captures it.

    Prompts are batched ``batch`` at a time in order of length (less left padding);
    samples come back in the prompts' order.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    samples: list[Sample | None] = [None] * len(prompts)
    for b in range(0, len(order), batch):
        group = order[b : b + batch]
        batch_samples = _generate_batch(
            model, [prompts[i] for i in group], max_new_tokens, aux_layer_ids, soft_top_k
        )
        for i, sample in zip(group, batch_samples, strict=True):
            samples[i] = sample
    return samples


def training_samples(model: nn.Module, prompts: list[list[int]], spec: DraftSpec) -> list[Sample]:
    """The draft's training answers: :func:`generate` at the spec's answer length, batch,
    aux layers and soft targets (one definition for the build and the shipped draft's
    training)."""
    return generate(
        model,
        prompts,
        max_new_tokens=spec.max_new_tokens,
        batch=spec.gen_batch,
        aux_layer_ids=spec.aux_layer_ids,
        soft_top_k=spec.soft_top_k,
    )


def _generate_batch(model, prompts, max_new_tokens, aux_layer_ids, soft_top_k) -> list[Sample]:
    from transformers import DynamicCache

    eos, pad = model.generation_config.eos_token_id, model.generation_config.pad_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [B, P]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    cache = DynamicCache(config=model.config)
    auxes, tops, fed = [], [], [ids]
    done = torch.zeros(len(prompts), dtype=torch.bool)
    # max_new_tokens + 1 forwards: the last one reads the final answer token, so every
    # token of a sample has its aux state and greedy successor.
    for _ in range(max_new_tokens + 1):
        positions = (mask.cumsum(-1) - 1).clamp_min(0)[:, -ids.shape[1] :]
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )
        auxes.append(torch.cat([out.hidden_states[a + 1] for a in aux_layer_ids], -1))
        tops.append(top_tokens(out.logits, soft_top_k))
        if done.all() or len(fed) > max_new_tokens:
            break
        ids = tops[-1][0][:, -1:, 0]
        done |= ids[:, 0] == eos
        fed.append(ids)
        mask = torch.cat([mask, torch.ones_like(ids)], 1)
    tokens, aux = torch.cat(fed, 1), torch.cat(auxes, 1)
    top_ids, top_probs = (torch.cat(parts, 1) for parts in zip(*tops, strict=True))
    samples = []
    for row, prompt in enumerate(prompts):
        answer = tokens[row, width:].tolist()
        n = width + (answer.index(eos) + 1 if eos in answer else len(answer))
        start = width - len(prompt)
        samples.append(
            Sample(
                tokens[row, start:n].clone(),
                aux[row, start:n].to(torch.bfloat16),
                top_ids[row, start:n].clone(),
                top_probs[row, start:n].clone(),
            )
        )
    return samples


@torch.no_grad()
def read_text(
    model: nn.Module,
    chunks: torch.Tensor,
    *,
    aux_layer_ids: tuple[int, ...],
    soft_top_k: int,
    batch: int = 4,
    log: Callable[[str], None] | None = None,
) -> list[Sample]:
    """Teacher-forced samples: the target reads text chunks, ``batch`` at a time.

    Args:
        chunks: int64 ``[B, L]`` token ids (packed chat-rendered text).
        log: receives a progress line about every 10% of the chunks.

    Returns:
        One sample per chunk: its tokens, the aux states after each (output of target layer
        a for a in ``aux_layer_ids``, as in :func:`generate`) and the target's top
        ``soft_top_k`` next tokens after each.
    """
    samples, start = [], time.perf_counter()
    for b in range(0, len(chunks), batch):
        ids = chunks[b : b + batch]
        out = model(input_ids=ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[a + 1] for a in aux_layer_ids], -1)
        top_ids, top_probs = top_tokens(out.logits, soft_top_k)
        samples += [
            Sample(row, row_aux, row_ids, row_probs)
            for row, row_aux, row_ids, row_probs in zip(
                ids, aux.to(torch.bfloat16), top_ids, top_probs, strict=True
            )
        ]
        if log is not None and len(samples) * 10 // len(chunks) > b * 10 // len(chunks):
            log(f"  read {len(samples)}/{len(chunks)} chunks ({time.perf_counter() - start:.0f}s)")
    return samples


@torch.no_grad()
def samples_from_states(
    model: nn.Module, ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor, soft_top_k: int
) -> list[Sample]:
    """Samples from a teacher-forced pass whose states are already known (calibration).

    Args:
        model: the ``LlamaForCausalLM`` whose final norm and lm_head give the next-token
            distributions.
        ids: int64 ``[B, L]``; aux: bfloat16 ``[B, L, A*H]``; final: float32 ``[B, L, H]``,
            the last decoder layer's output.
    """
    return [
        Sample(
            row_ids, row_aux, *top_tokens(model.lm_head(model.model.norm(row_final)), soft_top_k)
        )
        for row_ids, row_aux, row_final in zip(ids, aux, final, strict=True)
    ]


def _length_batches(items: list, batch_tokens: int, size: Callable) -> list[list]:
    # Consecutive groups in the given order whose padded size stays within batch_tokens.
    groups, group, width = [], [], 0
    for item in items:
        new_width = max(width, size(item))
        if group and new_width * (len(group) + 1) > batch_tokens:
            groups.append(group)
            group, new_width = [], size(item)
        group.append(item)
        width = new_width
    return groups + [group] if group else groups


def draft_config(target_config, spec: DraftSpec) -> eagle3.Eagle3Config:
    """A draft as wide as the target (one decoder layer of the target's shape)."""
    return eagle3.Eagle3Config(
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=target_config.num_key_value_heads,
        vocab_size=target_config.vocab_size,
        draft_vocab_size=spec.vocab_size,
        aux_layer_ids=list(spec.aux_layer_ids),
        rms_norm_eps=target_config.rms_norm_eps,
        rope_theta=target_config.rope_parameters["rope_theta"],
        max_position_embeddings=target_config.max_position_embeddings,
    )


def init_draft(
    target: nn.Module,
    samples: list[Sample],
    text_counts: torch.Tensor,
    spec: DraftSpec,
    seed: int,
) -> eagle3.Eagle3Draft:
    """A fresh, randomly initialised draft.

    Its vocabulary is the ``spec.vocab_size`` tokens with the largest mean of two shares:
    of the target's greedy tokens in ``samples`` and of ``text_counts`` (token counts of a
    larger text sample). The samples alone hold too few distinct tokens: a vocabulary built
    from them covered only 83% of the target's tokens on MT-Bench answers, against 93% with
    the text counts mixed in (8192 tokens).

    (Copying the target's lm_head rows and final norm in as a warm start did not help:
    trained with EAGLE-1's feature loss, acceptance 1.33 against 1.33; frozen, 1.47 against
    1.49; see docs/testbed.md.)

    Args:
        text_counts: float ``[V]`` token counts.
    """
    config = draft_config(target.config, spec)
    draft = eagle3.init_weights(eagle3.Eagle3Draft(config), seed=seed)
    greedy = torch.zeros(config.vocab_size)
    for s in samples:
        greedy += torch.bincount(s.greedy, minlength=config.vocab_size)
    share = greedy / greedy.sum() + text_counts / text_counts.sum()
    draft.set_vocab_maps(*eagle3.build_vocab_maps(share, config.draft_vocab_size))
    return draft


def _ttt_mask(rows: int, step: int) -> torch.Tensor:
    """bool ``[T, (step+1)*T]``: causal over step 0's rows, diagonal over steps 1..step."""
    causal = torch.ones(rows, rows, dtype=torch.bool).tril()
    eye = torch.eye(rows, dtype=torch.bool)
    return torch.cat([causal] + [eye] * step, dim=1)


def _batch(samples: list[Sample], draft: eagle3.Eagle3Draft, embed: nn.Embedding, steps: int):
    """Right-padded tensors for one optimisation step.

    Row t of step k reads token t+1+k and learns the target's distribution after it.
    Returns embeds ``[S, B, T, H]``, aux ``[B, T, A*H]`` float32, and soft labels: draft
    ids ``[S, B, T, k]`` (-100 where padding or outside the draft vocabulary) with their
    target probabilities ``[S, B, T, k]`` (0 where the id is -100).
    """
    rows = max(len(s.tokens) for s in samples) - 1
    k = samples[0].top_ids.shape[1]
    tokens = torch.zeros(len(samples), rows + steps, dtype=torch.long)
    top_ids = torch.full((len(samples), rows + steps, k), -1, dtype=torch.long)
    top_probs = torch.zeros(len(samples), rows + steps, k)
    aux = torch.zeros(len(samples), rows, samples[0].aux.shape[1])
    for i, s in enumerate(samples):
        n = len(s.tokens)
        tokens[i, : n - 1] = s.tokens[1:]
        top_ids[i, : n - 1] = s.top_ids[1:]
        top_probs[i, : n - 1] = s.top_probs[1:]
        aux[i, : n - 1] = s.aux[:-1].float()
    ids = draft.to_draft_ids(top_ids.clamp_min(0)).masked_fill(top_ids < 0, eagle3.IGNORE_INDEX)
    probs = top_probs.masked_fill(ids == eagle3.IGNORE_INDEX, 0.0)
    with torch.no_grad():
        embeds = embed(tokens)

    def shifted(x):
        return torch.stack([x[:, j : j + rows] for j in range(steps)])

    return shifted(embeds), aux, shifted(ids), shifted(probs)


def unrolled_loss(draft, embeds, aux, label_ids, label_probs, decay: float):
    """Weighted soft-label cross-entropy over S unrolled steps, plus per-step accuracy.

    Args: embeds ``[S, B, T, H]``, aux ``[B, T, A*H]``, label_ids and label_probs
        ``[S, B, T, k]`` from :func:`_batch`. A row's labels are its probabilities
        renormalised over the valid ids; rows whose greedy token is outside the draft
        vocabulary (or padding) are skipped.
    Returns: (loss scalar, accuracies: per step, how often the draft's argmax is the
        target's greedy token).
    """
    steps, batch, rows, _ = embeds.shape
    hidden, past, loss, accs = aux, None, 0.0, []
    for k in range(steps):
        positions = (torch.arange(rows) + k).expand(batch, -1)
        mask = None if k == 0 else _ttt_mask(rows, k).expand(batch, -1, -1)
        out = draft(embeds[k], hidden, positions, past=past, attn_mask=mask)
        ids, probs = label_ids[k], label_probs[k]  # [B, T, k]
        valid = ids[..., 0] != eagle3.IGNORE_INDEX  # [B, T]
        logp = torch.log_softmax(out.logits[valid].float(), -1)  # [N, D]
        weights = probs[valid] / probs[valid].sum(-1, keepdim=True)  # [N, k]
        picked = logp.gather(1, ids[valid].clamp_min(0))  # [N, k]
        loss = loss + decay**k * -(weights * picked).sum(-1).mean()
        accs.append((logp.argmax(-1) == ids[valid][:, 0]).float().mean().item())
        keys = out.key if past is None else torch.cat([past[0], out.key], 2)
        values = out.value if past is None else torch.cat([past[1], out.value], 2)
        past, hidden = (keys, values), out.hidden
    return loss, accs


def train_draft(
    draft: eagle3.Eagle3Draft,
    embed: nn.Embedding,
    samples: list[Sample],
    spec: DraftSpec,
    generator: torch.Generator,
    log: Callable[[str], None] = print,
    *,
    checkpoint: Path | None = None,
    until_epoch: int | None = None,
) -> list[dict]:
    """Trains ``draft`` in place (AdamW, linear warmup then cosine decay over
    ``spec.epochs``), with matmuls in bf16 when ``spec.bf16_autocast``.

    Args:
        checkpoint: a file saved after every epoch (draft, optimiser, schedule, generator,
            history); when it exists, training resumes after its last epoch.
        until_epoch: stop after this many epochs (the schedule still spans
            ``spec.epochs``), so a long run can be exported part way, reproducibly.

    Returns one dict per epoch: mean loss and mean per-step accuracy.
    """

    def rows(sample: Sample) -> int:
        return len(sample.tokens)

    batches = _length_batches(sorted(samples, key=rows), spec.batch_tokens, rows)
    total = spec.epochs * len(batches)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda i: (
            min(1.0, (i + 1) / warmup)
            * 0.5
            * (1 + torch.cos(torch.tensor(torch.pi * i / total)).item())
        ),
    )
    history = []
    if checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["schedule"])
        generator.set_state(state["generator"])
        history = state["history"]
        log(f"  resumed from {checkpoint} after epoch {len(history) - 1}")
    stop = spec.epochs if until_epoch is None else min(until_epoch, spec.epochs)
    draft.train()
    for epoch in range(len(history), stop):
        start, losses, accs = time.perf_counter(), [], []
        for b in torch.randperm(len(batches), generator=generator).tolist():
            embeds, aux, ids, probs = _batch(batches[b], draft, embed, spec.ttt_steps)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.bf16_autocast):
                loss, step_accs = unrolled_loss(draft, embeds, aux, ids, probs, spec.ttt_decay)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            accs.append(step_accs)
        mean_accs = [sum(col) / len(col) for col in zip(*accs, strict=True)]
        history.append({"epoch": epoch, "loss": sum(losses) / len(losses), "acc": mean_accs})
        log(
            f"  epoch {epoch}: loss {history[-1]['loss']:.3f} acc "
            + "/".join(f"{a:.3f}" for a in mean_accs)
            + f" ({time.perf_counter() - start:.0f}s)"
        )
        if checkpoint is not None:
            state = {
                "draft": draft.state_dict(),
                "optimizer": opt.state_dict(),
                "schedule": sched.state_dict(),
                "generator": generator.get_state(),
                "history": history,
            }
            torch.save(state, checkpoint.with_suffix(".tmp"))
            checkpoint.with_suffix(".tmp").replace(checkpoint)
    draft.eval()
    return history
