"""Training: one step over any set of expert workers, the optimizer, checkpoints, the run summary.

`step` holds the master's side of a step (`train_step`, `eval_loss`, export and import of
adapters) over the `ExpertWorkers` control plane; `zo` the zeroth-order step (`training.method:
zo`); `optim` the AdamW and ZO-noise pieces both sides share; `checkpoint` the atomic on-disk
format; `tiny_model` pre-trains the demo model. `equivalence` trains one model with vela-ray and
with plain peft side by side, and `family_check` uses it at preflight on any family the test suite
did not verify (`verified_families.json`).
"""
