"""A GRPO + AIS update on megatron at DP2 and at TP2: λ and the first policy loss equal a single-process
reference in plain tensor arithmetic on transformers' log-probs, the gradient does not depend on the split, and the
metrics reach tensorboard."""
import math

import pytest
import torch

from conftest import make_model_dir
from distributed import spawn

B, S, GROUP = 8, 16, 4


def _rollout_batch(hf_dir):
    """A synthetic rollout batch: random responses, 'engine' log-probs = HF fp32 log-probs + FP8-like noise."""
    from transformers import AutoModelForCausalLM

    from megatron_ais.batch import RolloutBatch

    g = torch.Generator().manual_seed(5)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    seq = torch.randint(0, model.config.vocab_size, (B, S + 1), generator=g)
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    mask = torch.zeros(B, S)
    for i in range(B):  # prompts of 4 tokens, responses of different lengths (unequal per DP rank)
        mask[i, 3:3 + 2 + (i * 5) % 11] = 1.0
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens).logits.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    rollout = (logp + 0.15 * torch.randn(B, S, generator=g, dtype=torch.float64)).float() * mask
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1])
    return RolloutBatch(tokens, labels, mask, rollout, rewards, GROUP), logp.float()


def _worker(hf_dir, tp, log_dir):
    from megatron.core import parallel_state as ps

    from megatron_ais.ais import AISConfig, AISState
    from distributed import start_trainer
    from megatron_ais.grpo.loss import PolicyLossConfig
    from megatron_ais.forward import ParallelGroups
    from megatron_ais.grpo.step import GRPOConfig, grpo_train_step, rows_of_whole_batch
    from megatron_ais.logging import LoggingConfig, RunLogger, grpo_console_line
    from megatron_ais.training import build_reference_chunks, setup_model_and_optimizer

    trainer, _, build = start_trainer("--hf-dir", hf_dir, "--fp32", "--seq-length", S, "--tensor-model-parallel-size",
                                      tp, "--lr", "1e-3")
    setup = setup_model_and_optimizer(build, trainer.weights, trainer.training)
    build, chunks, ddp, optimizer = setup.build, setup.chunks, setup.ddp_chunks, setup.optimizer
    batch, _ = _rollout_batch(hf_dir)
    # DP2 adds a KL penalty to the initial policy: at the first step it is exactly zero and changes nothing
    kl_coef = 0.1 if tp == 1 else 0.0
    reference = build_reference_chunks(build, trainer.weights) if kl_coef else None
    config = GRPOConfig(loss=PolicyLossConfig(kl_coef=kl_coef), correction=AISConfig(),
                        vocab_size=build.shape.vocab_size, micro_batch_size=2)
    groups = ParallelGroups.from_parallel_state()
    result = grpo_train_step(ddp, optimizer, rows_of_whole_batch(batch, config, groups), config, AISState(), groups,
                             reference)
    logger = RunLogger(LoggingConfig(output_dir=log_dir), enabled=groups.data_parallel_rank == 0
                       and ps.get_tensor_model_parallel_rank() == 0)
    line = grpo_console_line(1, result.metrics)
    logger.step(1, result.metrics, line)
    logger.close()
    guards = None
    if tp == 1:  # guards: a NaN / -inf rollout log-prob excludes its sequence; an all-invalid batch is skipped
        batch.rollout_logprobs[0, 4] = float("nan")
        batch.rollout_logprobs[6, 5] = float("-inf")
        partial_result = grpo_train_step(ddp, optimizer, rows_of_whole_batch(batch, config, groups), config,
                                         AISState(), groups, reference)
        batch.rollout_logprobs[:] = float("nan")
        before = [p.detach().clone() for p in chunks[0].parameters()]
        skipped = grpo_train_step(ddp, optimizer, rows_of_whole_batch(batch, config, groups), config, AISState(),
                                  groups, reference)
        unchanged = all(torch.equal(a, p) for a, p in zip(before, chunks[0].parameters()))
        guards = (partial_result.skipped, partial_result.metrics["guard/excluded_sequences"], skipped.skipped,
                  unchanged, result.metrics["train/kl"], partial_result.metrics["train/kl"],
                  _refusals(ddp, optimizer, hf_dir, config, groups, reference))
    return result.ais.lam.hex(), result.metrics, line, guards, next(chunks[0].parameters()).device.type


def _refusals(ddp, optimizer, hf_dir, config, groups, reference):
    """A library caller's batches: a NaN advantage on a row without valid tokens trains (NaN x 0 reached the loss);
    one on a valid row, or NaN trainer log-probs on rank 0 alone, is refused by both DP ranks (rank 1 waited in
    the statistics' all-reduce)."""
    import contextlib
    import dataclasses

    from megatron_ais.ais import AISState
    from megatron_ais.errors import NonFiniteInputError
    from megatron_ais.grpo.step import grpo_train_step, rows_of_whole_batch

    rows = rows_of_whole_batch(_rollout_batch(hf_dir)[0], config, groups)
    silent = rows.mask.clone()
    silent[0] = 0
    advantages = rows.advantages.clone()
    advantages[0] = float("nan")
    trained = grpo_train_step(ddp, optimizer, dataclasses.replace(rows, mask=silent, advantages=advantages), config,
                              AISState(), groups, reference)
    out = [math.isfinite(trained.metrics["train/policy_loss"])]
    with contextlib.suppress(NonFiniteInputError):
        bad = advantages if groups.data_parallel_rank == 0 else rows.advantages
        grpo_train_step(ddp, optimizer, dataclasses.replace(rows, advantages=bad), config, AISState(), groups,
                        reference)
        out.append("advantages accepted")

    @contextlib.contextmanager
    def corrupt_on_rank0():
        hook = ddp[0].register_forward_hook(lambda module, inputs, output: output * float("nan")) \
            if groups.data_parallel_rank == 0 else None
        try:
            yield
        finally:
            if hook is not None:
                hook.remove()

    with contextlib.suppress(FloatingPointError):
        grpo_train_step(ddp, optimizer, rows, config, AISState(), groups, reference, forward_weights=corrupt_on_rank0)
        out.append("log-probs accepted")
    return out


def _group_advantages(batch) -> torch.Tensor:
    rewards = batch.rewards.double().view(-1, GROUP)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return (centred / (centred.pow(2).mean(dim=1, keepdim=True).sqrt() + 1e-6)).flatten()


def _ais_coefficients(batch, old) -> tuple[float, torch.Tensor]:
    """λ and each token's coefficient [B, S] in plain tensor arithmetic (docs/ais-method.md §2.4, no module of the
    package): group advantages (r − mean) / (population std + 1e-6); per token δ = log π_old − log π_rollout,
    w = e^δ; s_D = 1 − e^(−mean|δ| / τ); ρ = (Σw̃)² / (N Σw̃²) with w̃ = w held in [1/C, C];
    Γ = max(1, Σ min(w, C)² A² / Σ A²); λ = clip(s_D ρ / Γ, 0, 1); coefficient c = (1 − λ) + λ min(w, C)."""
    cap, tau = 2.0, 0.05
    valid = batch.mask.flatten() > 0
    adv = _group_advantages(batch).unsqueeze(-1).expand(B, S).flatten()[valid]
    delta = (old.double() - batch.rollout_logprobs.double()).flatten()[valid]
    w = delta.exp()
    band = w.clamp(1 / cap, cap)
    severity = 1 - math.exp(-delta.abs().mean().item() / tau)
    reliability = (band.sum() ** 2 / (len(w) * band.pow(2).sum())).item()
    variance = max(1.0, ((w.clamp(max=cap) * adv).pow(2).sum() / adv.pow(2).sum()).item())
    lam = min(max(severity * reliability / variance, 0.0), 1.0)
    weights = (old.double() - batch.rollout_logprobs.double()).exp().clamp(max=cap)
    return lam, ((1 - lam) + lam * weights) * batch.mask


def _reference(hf_dir):
    """λ and the first policy loss (`_ais_coefficients`). At the first update the policy is the old one (ratio 1,
    inside the clip band), so the token-mean loss is −Σ c A / tokens."""
    batch, old = _rollout_batch(hf_dir)
    lam, coefficient = _ais_coefficients(batch, old)
    adv = _group_advantages(batch).unsqueeze(-1).expand(B, S)
    return lam, (-(coefficient * adv).sum() / batch.mask.sum()).item()


@pytest.mark.slow
def test_grpo_ais_step_dp2_and_tp2_match_reference(model_root, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    hf_dir = make_model_dir(model_root, "qwen3")
    ref_lam, ref_loss = _reference(hf_dir)
    dp2 = spawn(2, _worker, hf_dir, 1, str(tmp_path / "dp2"))
    tp2 = spawn(2, _worker, hf_dir, 2, str(tmp_path / "tp2"))
    for lam_hex, metrics, line, *_ in dp2 + tp2:
        assert f"λ {float.fromhex(lam_hex):.4f}" in line and "excluded 0" in line
        assert float.fromhex(lam_hex) == pytest.approx(ref_lam, rel=1e-4)
        assert metrics["train/policy_loss"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    assert dp2[0][0] == dp2[1][0], "λ must be bit-identical on both DP ranks"
    assert 0 < ref_lam < 1
    # the normaliser is global: DP2 (unequal tokens per rank) and TP2 (one replica) give the same gradient
    assert dp2[0][1]["train/grad_norm"] == pytest.approx(tp2[0][1]["train/grad_norm"], rel=1e-4)
    assert dp2[0][1]["ais/max_abs_logratio"] == tp2[0][1]["ais/max_abs_logratio"] > 0
    assert dp2[0][3][:4] == (False, 2.0, True, True)
    kl_first, kl_later = dp2[0][3][4:6]
    assert dp2[0][3][6] == dp2[1][3][6] == [True]
    assert kl_first == 0.0 and kl_later > 0.0  # the policy moved away from the reference after one update
    events = EventAccumulator(str(tmp_path / "dp2" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("ais/lambda", "ais/severity", "ais/reliability", "ais/var_amp", "ais/k3_kl", "ais/chi2",
                "ais/ess_ratio_raw", "ais/max_abs_logratio", "ais/frac_truncated", "guard/excluded_sequences"):
        assert tag in tags, tag
    assert events.Scalars("ais/lambda")[0].value == pytest.approx(ref_lam, rel=1e-4)


@pytest.mark.gpu
def test_grpo_ais_step_on_cuda_matches_reference(model_root, tmp_path):
    """On a GPU the trainer holds the model and the batch there and gives the single-process CPU reference's λ and
    policy loss; the guards behave as on CPU (one rank, one GPU: the collectives have a single member)."""
    hf_dir = make_model_dir(model_root, "qwen3")
    ref_lam, ref_loss = _reference(hf_dir)
    ((lam_hex, metrics, line, guards, on),) = spawn(1, _worker, hf_dir, 1, str(tmp_path / "gpu"))
    assert on == "cuda"
    assert float.fromhex(lam_hex) == pytest.approx(ref_lam, rel=1e-4)
    assert metrics["train/policy_loss"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    assert guards[:4] == (False, 2.0, True, True) and guards[4] == 0.0 < guards[5]


def _options_worker(hf_dir, tp):
    """Dr. GRPO's aggregation at the initial policy (no correction), then a GSPO update with the geometric AIS
    correction; each step's loss and grad norm."""
    from megatron_ais.ais import AISConfig, AISState
    from distributed import start_trainer
    from megatron_ais.forward import ParallelGroups
    from megatron_ais.grpo.loss import PolicyLossConfig
    from megatron_ais.grpo.step import GRPOConfig, grpo_train_step, rows_of_whole_batch
    from megatron_ais.training import setup_model_and_optimizer

    trainer, _, build = start_trainer("--hf-dir", hf_dir, "--fp32", "--seq-length", S, "--tensor-model-parallel-size",
                                      tp, "--lr", "1e-3")
    setup = setup_model_and_optimizer(build, trainer.weights, trainer.training)
    batch, _ = _rollout_batch(hf_dir)
    groups = ParallelGroups.from_parallel_state()
    dr_grpo = GRPOConfig(loss=PolicyLossConfig(loss_agg="seq-mean-token-sum-norm", max_response_tokens=S),
                         correction=AISConfig(correction="none"), vocab_size=build.shape.vocab_size,
                         micro_batch_size=2)
    gspo = GRPOConfig(loss=PolicyLossConfig(policy_loss="gspo", loss_agg="seq-mean-token-mean"),
                      correction=AISConfig(level="geometric"), vocab_size=build.shape.vocab_size, micro_batch_size=2)
    results = [grpo_train_step(setup.ddp_chunks, setup.optimizer, rows_of_whole_batch(batch, config, groups), config,
                               AISState(), groups).metrics for config in (dr_grpo, gspo)]
    return [(m["train/policy_loss"], m["train/grad_norm"]) for m in results]


@pytest.mark.slow
def test_dr_grpo_and_gspo_steps_do_not_depend_on_the_split(model_root):
    """Dr. GRPO's loss at the initial policy is −Σ_i |y_i| A_i / (sequences × longest response) (ratio 1, c = 1);
    its gradient, and the next GSPO update's, are the same at DP2 (unequal tokens per rank) and TP2 (one replica)."""
    hf_dir = make_model_dir(model_root, "qwen3")
    batch, _ = _rollout_batch(hf_dir)
    rewards = batch.rewards.double().view(-1, GROUP)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    advantages = (centred / (centred.pow(2).mean(dim=1, keepdim=True).sqrt() + 1e-6)).flatten()
    expected = -(batch.mask.sum(dim=1).double() * advantages).sum().item() / (B * S)
    dp2 = spawn(2, _options_worker, hf_dir, 1)
    tp2 = spawn(2, _options_worker, hf_dir, 2)
    for (dr_loss, _), _ in dp2 + tp2:
        assert dr_loss == pytest.approx(expected, rel=1e-4, abs=1e-7)
    for step in range(2):
        assert dp2[0][step][1] == pytest.approx(tp2[0][step][1], rel=1e-4)
    assert dp2[0][1][1] > 0


MINIBATCHES, EPOCHS, LR = 2, 2, 1e-3


def _minibatch_worker(hf_dir):
    """--num-minibatches 2 --ppo-epochs 2 at DP2, micro-batches of one row: four Adam updates of one rollout batch."""
    from megatron_ais.ais import AISConfig, AISState
    from distributed import start_trainer
    from megatron_ais.forward import ParallelGroups
    from megatron_ais.grpo.loss import PolicyLossConfig
    from megatron_ais.grpo.step import GRPOConfig, grpo_train_step, rows_of_whole_batch
    from megatron_ais.training import setup_model_and_optimizer

    trainer, _, build = start_trainer("--hf-dir", hf_dir, "--fp32", "--seq-length", S, "--lr", LR)
    setup = setup_model_and_optimizer(build, trainer.weights, trainer.training)
    config = GRPOConfig(loss=PolicyLossConfig(), correction=AISConfig(), vocab_size=build.shape.vocab_size,
                        micro_batch_size=1, num_minibatches=MINIBATCHES, ppo_epochs=EPOCHS)
    groups = ParallelGroups.from_parallel_state()
    result = grpo_train_step(setup.ddp_chunks, setup.optimizer, rows_of_whole_batch(_rollout_batch(hf_dir)[0], config,
                                                                                    groups), config, AISState(), groups)
    return result.ais.lam, result.metrics


def _minibatch_reference(hf_dir, ranks: int) -> tuple[float, list[float], list[float], float]:
    """The same updates on transformers' model with torch's Adam: λ and c from the batch before the first update,
    held; each mini-batch is every DP rank's next share of its rows; PPO-clip (0.8, 1.28) token-mean over the
    mini-batch; the gradient's norm clipped to 1. Return λ, each update's loss and pre-clip grad norm, and the
    clipped fraction of all updates' tokens."""
    from transformers import AutoModelForCausalLM

    batch, old = _rollout_batch(hf_dir)
    lam, coefficient = _ais_coefficients(batch, old)
    advantages = _group_advantages(batch).float().unsqueeze(-1).expand(B, S)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    adam = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8)
    per_rank = B // ranks
    share = per_rank // MINIBATCHES
    losses, norms, clipped, tokens = [], [], 0.0, 0.0
    for _ in range(EPOCHS):
        for k in range(MINIBATCHES):
            rows = [r * per_rank + k * share + i for r in range(ranks) for i in range(share)]
            logits = model(batch.tokens[rows]).logits
            logp = torch.log_softmax(logits, -1).gather(-1, batch.labels[rows].unsqueeze(-1)).squeeze(-1)
            ratio = (logp - old[rows]).exp()
            a, mask = advantages[rows], batch.mask[rows]
            unclipped, held = -a * ratio, -a * ratio.clamp(0.8, 1.28)
            loss = (coefficient[rows].float() * torch.maximum(unclipped, held) * mask).sum() / mask.sum()
            clipped += ((held > unclipped).float() * mask).sum().item()
            tokens += mask.sum().item()
            adam.zero_grad()
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
            adam.step()
            losses.append(loss.item())
    return lam, losses, norms, clipped / tokens


@pytest.mark.slow
def test_minibatches_and_epochs_are_adam_updates_with_the_old_policy_held(model_root):
    """Four updates of one batch (two mini-batches, two epochs, DP2) reach the losses and grad norm of the same
    updates on transformers' model with torch's Adam: the old log-probs and λ are the batch's before the first
    update, each mini-batch is normalised by its own tokens over DP, and the clip bites in the later updates."""
    hf_dir = make_model_dir(model_root, "qwen3")
    lam, losses, norms, clip_fraction = _minibatch_reference(hf_dir, ranks=2)
    (rank0_lam, metrics), (rank1_lam, _) = spawn(2, _minibatch_worker, hf_dir)
    assert rank0_lam == rank1_lam == pytest.approx(lam, rel=1e-4)
    assert metrics["train/policy_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-3)
    assert metrics["train/grad_norm"] == pytest.approx(norms[-1], rel=1e-3)
    assert metrics["train/clip_fraction"] == pytest.approx(clip_fraction, abs=1e-3)
    assert clip_fraction > 0 and len(set(round(x, 4) for x in losses)) == len(losses)


def test_a_batch_without_advantages_is_refused_before_any_forward():
    from megatron_ais.ais import AISConfig, AISState
    from megatron_ais.batch import RolloutBatch
    from megatron_ais.grpo.loss import PolicyLossConfig
    from megatron_ais.grpo.step import GRPOConfig, grpo_train_step

    ones = torch.ones(GROUP, S)
    batch = RolloutBatch(ones.long(), ones.long(), ones, -ones, torch.zeros(GROUP), GROUP)
    config = GRPOConfig(loss=PolicyLossConfig(), correction=AISConfig(), vocab_size=16)
    with pytest.raises(ValueError, match="the rollout batch has no advantages"):
        grpo_train_step([], None, batch, config, AISState(), groups=None)
