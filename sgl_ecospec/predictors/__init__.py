"""Expert predictors: which experts each draft candidate will activate in the target.

EcoSpec ranks draft candidates by the experts they would add to the verify pass, so it needs,
for every candidate token, a guess of its top-K experts in every MoE layer of the target
before the target runs. The predictors learn from the routing the target actually produced
during verification, behind one interface (:class:`ExpertPredictor`):

- :class:`OnlineExpertPredictor` (``online``): per-token routing counts in a hashed table,
  plus a global per-layer frequency prior. Costs a gather and a top-k; needs no training.
- :class:`ContextExpertPredictor` (``context``): routing counts per token (every token its
  own row where memory allows, compact counts) and per (parent token, token) pair, backing
  off pair -> token -> global frequency; predictions are cached top-K rows (a few gathers).
- :class:`AdjacentExpertPredictor` (``adjacent``): ``context`` whose cached rows lean towards
  the latest routing, and whose unseen tokens take their parent token's experts.
- :class:`LowRankExpertHead` (``head``): a small low-rank head on the drafter's hidden state
  and the candidate token, trained offline with :func:`train_expert_head` (``training``;
  the CLI's ``sgl-ecospec train-head``) and/or online through ``observe``.

:func:`load_predictor` (``loading``) reads a file saved by any (formats: ``state``);
:func:`make_predictor` (``catalog``) builds a fresh online one by name; :class:`LiveRecall`
(``live_recall``) measures a predictor's recall per layer while it serves.
"""

from sgl_ecospec.predictors.adjacent import AdjacentExpertPredictor
from sgl_ecospec.predictors.base import ExpertPredictor, multi_hot, topk_recall
from sgl_ecospec.predictors.catalog import ONLINE_PREDICTORS, make_predictor
from sgl_ecospec.predictors.context import ContextExpertPredictor
from sgl_ecospec.predictors.head import LowRankExpertHead
from sgl_ecospec.predictors.live_recall import LiveRecall
from sgl_ecospec.predictors.loading import load_predictor
from sgl_ecospec.predictors.online import OnlineExpertPredictor, hash_buckets
from sgl_ecospec.predictors.training import train_expert_head

__all__ = [
    "ONLINE_PREDICTORS",
    "AdjacentExpertPredictor",
    "ContextExpertPredictor",
    "ExpertPredictor",
    "LiveRecall",
    "LowRankExpertHead",
    "OnlineExpertPredictor",
    "hash_buckets",
    "load_predictor",
    "make_predictor",
    "multi_hot",
    "topk_recall",
    "train_expert_head",
]
