"""Training-time code: learned gates on a frozen model (`train_gates`), a small fine-tuning loop
(`finetune`) and the aids it offers (`aids`): L1 gradient re-weighting, a head-agreement KL
term and online silence re-calibration. May import `compression`, `calibration`, `runtime` and
everything below."""

from sparse_engine.training.train_gates import GateTraining, TrainedGates, train_gates

__all__ = ["GateTraining", "TrainedGates", "train_gates"]
