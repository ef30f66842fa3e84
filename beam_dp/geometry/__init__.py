"""Geometry for constrained and non-Euclidean DP optimization (issue 13; paper note 004).

numpy/scipy only (no Beam import): these are driver-side kernels. The DP algorithms of note 004
release a noisy point and then post-process it (a Euclidean projection onto the public constraint
set C, or a mirror step), so nothing here touches private data directly; but their inputs are
private-until-noised values, so nothing here prints or echoes a value, and error messages name
only public quantities (shapes, exponents, the kind of constraint).

Contents, one module each, with the note's section:

* ``norms``: norms and duality (6.1): ``lp_norm`` (overflow-safe), ``dual_exponent``,
  ``dual_norm``, and the exponents of the l_p algorithms (``kappa_lp``, ``mirror_exponent``,
  ``noise_norm_exponent``);
* ``mirror``: the p-norm mirror map Phi_r(x) = ||x||_r^2 / (2 (r - 1)), 1 < r <= 2 (6.2 with
  erratum 9.1);
* ``generalized_gaussian``: the exact sampler GG_{||.||_r}(0, sigma^2) (Def. 4, 6.3);
* ``projections``: Euclidean projections onto the l2 ball, l1 ball, scaled simplex, box and
  convex hull (6.4);
* ``widths``: Gaussian widths G_C = E sup_{w in C} <xi, w> (Def. 12, 4.2, 6.6);
* ``constraint``: ``Constraint``, one public, JSON-serialisable description of C used by all of
  the above;
* ``checks``: the input checks and floating-point context they share.

Why a package whose ``__init__`` names the public API: the algorithms and tests read these names
as ``geometry.X``, one obvious place for the geometry of note 004, whichever module defines them
(and a test that patches ``geometry.project_l1_ball`` reaches ``stats``'s sparse mean, which
looks it up here).

Conventions. Vectors live on the last axis: norms, projections (except the hull, one QP per
point), mirror maps and support functions accept (d,) or (n, d). Overflow and underflow are
handled explicitly (a finite 1e200 entry must neither give inf/NaN nor lose the small entries),
so the kernels run under ``np.errstate`` and print nothing: a floating-point warning that
appears only for some inputs would itself say something about them.
"""
from beam_dp.geometry.constraint import KINDS, Constraint
from beam_dp.geometry.generalized_gaussian import gg_log_normalizer, sample_gg
from beam_dp.geometry.mirror import (bregman_divergence, mirror_conjugate, mirror_grad,
                                     mirror_grad_inverse, mirror_map)
from beam_dp.geometry.norms import (dual_exponent, dual_norm, kappa_lp, lp_norm, mirror_exponent,
                                    noise_norm_exponent)
from beam_dp.geometry.projections import (project_box, project_hull, project_l1_ball,
                                          project_l2_ball, project_simplex)
from beam_dp.geometry.widths import (gaussian_width_box, gaussian_width_l1_ball,
                                     gaussian_width_l2_ball, gaussian_width_mc,
                                     gaussian_width_simplex)

__all__ = [
    "KINDS", "Constraint",
    "gg_log_normalizer", "sample_gg",
    "bregman_divergence", "mirror_conjugate", "mirror_grad", "mirror_grad_inverse", "mirror_map",
    "dual_exponent", "dual_norm", "kappa_lp", "lp_norm", "mirror_exponent", "noise_norm_exponent",
    "project_box", "project_hull", "project_l1_ball", "project_l2_ball", "project_simplex",
    "gaussian_width_box", "gaussian_width_l1_ball", "gaussian_width_l2_ball", "gaussian_width_mc",
    "gaussian_width_simplex",
]
