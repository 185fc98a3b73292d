# Throwaway probe: the Wan transformer's inputs (shape, dtype, requires_grad, stride) at every call of
# steps 3-4, and the FLOPs of step 3 (forward + backward, torch.utils.flop_counter), to $SHAPES_OUT.
import os
_out = os.environ.get("SHAPES_OUT")
if _out:
    import json
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.utils.flop_counter import FlopCounterMode
    S = {"step": 0, "fc": None}
    def desc(v):
        if isinstance(v, torch.Tensor):
            return {"shape": list(v.shape), "dtype": str(v.dtype), "requires_grad": v.requires_grad, "contiguous": v.is_contiguous(),
                    "abs_sum": float(v.detach().abs().sum()), "nonzero_rows": int((v.detach().reshape(-1, v.shape[-1]).abs().sum(-1) > 0).sum()) if v.ndim >= 2 else None}
        return repr(v)[:80]
    seen = {}
    def pre(mod, args):
        if S["step"] in (2, 3):
            name = type(mod).__name__
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if x is None:
                return
            key = None
            if name == "Conv3d":
                key = "patch_embedding input"
            elif name == "Linear" and getattr(mod, "in_features", 0) == 4096:
                key = "text_embedder linear_1 input"
            elif name in ("Linear", "lora.Linear") and x.ndim == 3:
                key = f"{name} in={mod.in_features if hasattr(mod, 'in_features') else '?'} seq={x.shape[1]}"
            if key is not None:
                k = (S["step"], key, tuple(x.shape), x.requires_grad)
                seen[k] = seen.get(k, 0) + 1
            if name == "Conv3d" and S["step"] == 2 and S["fc"] is None:
                S["fc"] = FlopCounterMode(display=False); S["fc"].__enter__()
    register_module_forward_pre_hook(pre)
    def opt_pre(opt, a, k):
        if S["fc"] is not None and S["step"] == 2:
            S["fc"].__exit__(None, None, None)
            flops = S["fc"].get_flop_counts()
            with open(_out, "a") as f:
                f.write(json.dumps({"flops_total": S["fc"].get_total_flops(), "by_op": {str(k): v for k, v in flops.get("Global", {}).items()},
                                    "trainable": sum(p.numel() for g in opt.param_groups for p in g["params"])}) + "\n")
    def opt_post(opt, a, k):
        S["step"] += 1
        if S["step"] == 4:
            with open(_out, "a") as f:
                for (step, key, shape, rg), n in sorted(seen.items(), key=str):
                    f.write(json.dumps({"step": step + 1, "what": key, "shape": list(shape), "requires_grad": rg, "calls": n}) + "\n")
    register_optimizer_step_pre_hook(opt_pre); register_optimizer_step_post_hook(opt_post)
