"""Names torchmetrics imports when it finds a torchvision (its detection metrics); no tutorial here calls them."""


def _not_here(name: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"torchvision.ops.{name} is not in the torchvision stand-in (tests/lightning_tutorials)")

    refuse.__name__ = name
    return refuse


box_area, box_convert, box_iou = _not_here("box_area"), _not_here("box_convert"), _not_here("box_iou")
distance_box_iou, generalized_box_iou = _not_here("distance_box_iou"), _not_here("generalized_box_iou")
complete_box_iou = _not_here("complete_box_iou")
