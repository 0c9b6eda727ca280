"""``solar.DataLoader`` is generic like ``torch.utils.data.DataLoader`` (``Generic[T_co]``), so
annotations and subclasses written for torch's loader work unchanged with the drop-in."""

import typing

import torch
import torch.utils.data as tud

import solar


def test_subscript_like_torch():
    alias = solar.DataLoader[int]
    assert typing.get_origin(alias) is solar.DataLoader
    assert typing.get_args(alias) == (int,)
    assert typing.get_args(tud.DataLoader[int]) == (int,)


def test_subclass_of_subscripted_loader_works():
    class L(solar.DataLoader[torch.Tensor]):
        pass

    data = torch.arange(10.0)
    loader = L(data, batch_size=4)
    assert isinstance(loader, solar.DataLoader) and isinstance(loader, tud.DataLoader)
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
