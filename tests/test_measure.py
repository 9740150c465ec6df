import torch

from optremat.runtime.measure import measure_peak, resident_bytes


def test_meter_matches_a_hand_count():
    def step():
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(2000)  # 8000 B, 12000 live
        del a  # 8000 live
        c = torch.empty(500, dtype=torch.float64)  # 4000 B, 12000 live
        d = torch.empty(1024)  # 4096 B, 16096 live: the peak
        return b, c, d

    weights = torch.empty(256)
    peak = measure_peak(step, resident=[weights, weights[:10]])
    assert peak.step_peak_bytes == 16096
    assert peak.resident_bytes == 1024
    assert peak.peak_bytes == 17120


def test_resident_counts_each_storage_once():
    x = torch.empty(100)
    assert resident_bytes([x, x.view(10, 10), [x[1:]], {"y": torch.empty(3, dtype=torch.int8)}]) == 403
