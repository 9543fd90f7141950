"""The planner: the paper's theory and a measured-curve cost model as pure functions (no torch).

profile data (Profile, JSON) -> predict each candidate chain -> a ranked table (Plan) -> markdown.
The measuring side lives apart, in polybasic.planner.measure (it imports torch and the runtime).
"""
from polybasic.planner.cost import ChainConfig, Prediction, predict, predict_lemma
from polybasic.planner.profile import CostCurve, LevelProfile, PairProfile, Profile
from polybasic.planner.search import Plan, Row, SearchSpace, candidate_chains, plan, render_markdown
from polybasic.planner.theory import (
                                      Insertion,
                                      Verdict,
                                      acceptance_rate,
                                      expected_accepted_length,
                                      lemma_3_1,
                                      phi,
                                      theorem_3_2,
)

__all__ = ["ChainConfig", "CostCurve", "Insertion", "LevelProfile", "PairProfile", "Plan", "Prediction", "Profile",
           "Row", "SearchSpace", "Verdict", "acceptance_rate", "candidate_chains", "expected_accepted_length",
           "lemma_3_1", "phi", "plan", "predict", "predict_lemma", "render_markdown", "theorem_3_2"]
