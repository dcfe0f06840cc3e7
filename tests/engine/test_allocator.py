from protrain.runtime.allocator import SETTING, prefer_expandable_segments


def test_sets_expandable_segments_when_unset(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert prefer_expandable_segments() is True
    import os

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == SETTING


def test_never_changes_a_users_setting(monkeypatch):
    import os

    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
        monkeypatch.setenv(var, "max_split_size_mb:128")
        assert prefer_expandable_segments() is False
        assert os.environ[var] == "max_split_size_mb:128"
        other = {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} - {var}
        assert all(v not in os.environ for v in other)
