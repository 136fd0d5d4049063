"""Check: did every stage run under the same releases of the packages that change numerics?

Each stage manifest records the versions of torch, transformers, sglang and a few others
(draftlab.manifest.package_versions). Features extracted under one transformers and a draft
served under another is a real case: a `pip install` on a later day resolves newer releases, a
teammate re-runs one stage in their own environment, or a GPU machine serves with SGLang's pins
(transformers 5.8.1 for SGLang 0.5.14) what a CPU machine extracted under the lock's transformers.
A new release can change kernels, defaults or dtype handling, so offline and served figures
that disagree may be the release, not the configuration. One warning per package whose
recorded versions differ, naming both versions and the stages of each. Pure: manifests in,
Findings out.
"""
from __future__ import annotations

from draftlab.check.findings import Finding, warning

# Packages whose release changes what a stage computes (kernels, attention defaults, dtype rules).
NUMERICS = ("torch", "transformers", "sglang")


def recorded_versions(manifests: dict[str, dict | None], package: str) -> dict[str, list[str]]:
    """{version: [stages]} of `package` over `manifests` (stage name -> manifest, None where absent),
    in the stages' order. A stage that did not have the package installed (None) is left out: a
    CPU machine without SGLang extracts, a GPU machine with it serves, and that is no drift."""
    out: dict[str, list[str]] = {}
    for name, manifest in manifests.items():
        version = ((manifest or {}).get("packages") or {}).get(package)
        if version:
            out.setdefault(str(version), []).append((manifest or {}).get("stage") or name)
    return out


def check_package_drift(manifests: dict[str, dict | None]) -> list[Finding]:
    """One `package_versions_differ` warning per NUMERICS package recorded with two or more versions."""
    out = []
    for package in NUMERICS:
        versions = recorded_versions(manifests, package)
        if len(versions) < 2:
            continue
        listed = " against ".join(f"{package} {v} ({', '.join(stages)})" for v, stages in versions.items())
        out.append(warning(
            "package_versions_differ",
            {"package": package, "versions": versions},
            f"the stages ran under different releases of {package}: {listed}; a release can change kernels, "
            "defaults or dtype handling, so figures compared across these stages (offline against served tau, "
            "extracted against live hidden states) may differ because of the release, not the configuration",
            f"install one {package} release wherever the pipeline runs (pip install -c constraints/cpu.txt ..., "
            "see docs/environment.md), then re-run the stages listed under the other release "
            "(dvc repro --force -s STAGE)",
        ))
    return out
