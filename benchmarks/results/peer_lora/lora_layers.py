# Prints the peft LoRA layer settings of one targeted module and the set of targeted modules.
import sys, json, torch
from diffusers import WanTransformer3DModel
t = WanTransformer3DModel.from_pretrained(sys.argv[1] + "/transformer")
t.requires_grad_(False)
if sys.argv[2] == "ft":
    from peft import LoraConfig
    t.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights=True, target_modules="blocks.*(to_q|to_k|to_v|to_out.0)"))
else:
    from fv_accel.config import LoraConfig
    from fv_accel.models.lora import apply_lora, with_default_targets
    from fv_accel.models.wan import WanStudent
    apply_lora(t, with_default_targets(LoraConfig(enable=True, rank=16, alpha=16), WanStudent.lora_target_modules))
m = t.blocks[0].attn2.to_k
targets = sorted(n for n, mod in t.named_modules() if hasattr(mod, "lora_A"))
print(json.dumps({"dropout": repr(m.lora_dropout["default"]), "scaling": m.scaling["default"], "fan_in_fan_out": m.fan_in_fan_out,
                  "use_dora": m.use_dora["default"], "base_dtype": str(m.base_layer.weight.dtype), "lora_dtype": str(m.lora_A["default"].weight.dtype),
                  "base_requires_grad": m.base_layer.weight.requires_grad, "n_targets": len(targets), "targets_md5": __import__("hashlib").md5(" ".join(targets).encode()).hexdigest()[:12],
                  "trainable": sum(p.numel() for p in t.parameters() if p.requires_grad)}))
