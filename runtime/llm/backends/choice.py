"""Model backends and the choice between them (``[llm] backend``).

- :class:`~runtime.llm.backends.ollama.OllamaBackend` talks to an Ollama server (``[ollama] url``),
  and to a second one for the cloud route when ``[ollama] cloud_url`` is set.
- :class:`~runtime.llm.backends.offline.OfflineBackend` needs no network: schema-valid instances
  derived from a hash of the prompt, every string labelled ``offline:``.
- :class:`~runtime.llm.backends.embedded.EmbeddedBackend` runs a GGUF model in this process
  (llama.cpp; the ``embedded`` extra).
- :class:`~runtime.llm.backends.replay.ReplayBackend` serves the responses of a recorded run.

:func:`build_backend` picks one and says, in one sentence, which and why (``auto``: Ollama
if it answers within :data:`PROBE_TIMEOUT_SECONDS`, else the embedded model when its extra
is installed, else offline).
"""

from __future__ import annotations

from runtime.config import Settings
from runtime.llm.backends.offline import OfflineBackend
from runtime.llm.reply import PROBE_TIMEOUT_SECONDS, Backend, BackendConfigError


# ---------------------------------------------------------------------- choice
def build_backend(settings: Settings,
                  probe_timeout: float = PROBE_TIMEOUT_SECONDS) -> tuple[Backend, str]:
    """Build the backend ``[llm] backend`` asks for; return it and a sentence saying why.

    Raises:
        BackendConfigError: ``replay`` without a readable ``[llm] replay_file``;
            ``embedded`` without its extra or its model file.

    """
    choice = settings.llm.backend
    if choice == "offline":
        return OfflineBackend(), (
            "using the offline backend (llm.backend = 'offline'): deterministic answers, "
            "labelled offline, no network")
    if choice == "replay":
        from runtime.llm.backends.replay import ReplayBackend

        if not settings.llm.replay_file:
            raise BackendConfigError(
                "llm.backend = 'replay' needs llm.replay_file (or ORGCHART_LLM__REPLAY_FILE)"
                "; write one with 'orgchart llm record ROOT_ID --out FILE'")
        replay = ReplayBackend(settings.llm.replay_file)
        source = " (recorded with the offline backend)" if replay.offline else ""
        return replay, (f"replaying {replay.size} recorded responses from {replay.path}"
                        f"{source} (llm.backend = 'replay')")
    if choice == "embedded":
        from runtime.llm.backends.embedded import EmbeddedBackend, extra_installed

        if not extra_installed():
            raise BackendConfigError(
                "llm.backend = 'embedded' needs the embedded extra (llama-cpp-python and "
                "a model); install it with 'make install-embedded'")
        embedded = EmbeddedBackend.from_settings(settings)
        return embedded, (f"using the embedded model {embedded.path.name} in this process "
                          "(llm.backend = 'embedded')")
    # Loaded only here: the ollama client and httpx take a tenth of a second to import,
    # which every offline worker and CLI command would pay at start-up.
    from runtime.llm.backends.ollama import OllamaBackend

    backend = OllamaBackend.from_settings(settings)
    cloud = (f"; the cloud route goes to {backend.cloud_url}" if backend.cloud_url else "")
    if choice == "ollama":
        up = backend.probe(probe_timeout)
        note = "" if up else ("; it does not answer now, so calls fail as transient errors "
                              "and are retried until it does")
        return backend, f"using Ollama at {backend.url} (llm.backend = 'ollama'){cloud}{note}"
    if backend.probe(probe_timeout):
        return backend, (f"Ollama answered at {backend.url}; using it "
                         f"(llm.backend = 'auto'){cloud}")
    backend.close()
    return _embedded_or_offline(settings, f"no Ollama answered at {backend.url}")


def _embedded_or_offline(settings: Settings, why: str) -> tuple[Backend, str]:
    """``auto`` without Ollama: the embedded model when its extra is installed, else offline."""
    from runtime.llm.backends.embedded import EmbeddedBackend, extra_installed

    if not extra_installed():
        return OfflineBackend(), (
            f"{why} and the embedded extra is not installed ('make install-embedded'); "
            "using the offline backend (deterministic, labelled offline)")
    try:
        embedded = EmbeddedBackend.from_settings(settings)
    except BackendConfigError as exc:
        return OfflineBackend(), (f"{why} and the embedded model cannot be used ({exc}); "
                                  "using the offline backend (deterministic, labelled offline)")
    return embedded, (f"{why}; using the embedded model {embedded.path.name} in this "
                      "process (llm.backend = 'auto', the embedded extra is installed)")
