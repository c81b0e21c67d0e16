//! Parameter groups resolved: the rule each parameter is updated by (learning-rate scale,
//! weight decay, LARS's adaptation, frozen), from the `param_groups` section
//! ([`ParamGroupsConfig`]) and the model's parameter names and shapes.
//!
//! The default rule: the optimizer's weight decay, and LARS's adaptation, on every parameter
//! of two or more dimensions; none on the others (biases, normalisation gains and shifts,
//! CLIP's logit scale, SigLIP's logit bias) while `param_groups.exclude_1d` is true, as
//! OpenCLIP and solo-learn train them. A group's keys override it for its parameters.
//!
//! A checkpoint records every parameter's rule; a run resumes only with the same rules
//! ([`check_resume`]). A checkpoint written before the rules were recorded was trained with
//! [`legacy`]'s.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::groups::name_matches;
use crate::config::{OptimConfig, ParamGroupsConfig};

/// How one parameter is updated.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamRule {
    /// Frozen: never updated, no gradient, no optimizer state (the other fields are then 0 and
    /// false).
    pub frozen: bool,
    /// The parameter's learning rate is the schedule's times this.
    pub lr_scale: f64,
    /// Its weight decay (the optimizer's kind says how it is applied).
    pub weight_decay: f64,
    /// LARS: whether the trust ratio scales its update (false for the other optimizers).
    pub lars_adaptation: bool,
}

impl ParamRule {
    fn describe(&self) -> String {
        if self.frozen {
            return "frozen".into();
        }
        format!(
            "lr_scale {}, weight_decay {}{}",
            self.lr_scale,
            self.weight_decay,
            if self.lars_adaptation { ", LARS adaptation" } else { "" }
        )
    }
}

/// The rule of a parameter of `dims` when every parameter follows `optim` as written, as
/// before parameter groups existed (and for [`crate::optim::Optimizer::new`] without rules):
/// weight decay on every parameter under SGD and AdamW; under LARS, neither weight decay nor
/// adaptation on 1-D parameters while its `exclude_1d` is true.
pub fn legacy(optim: &OptimConfig, dims: &[usize]) -> ParamRule {
    let excluded = matches!(optim, OptimConfig::Lars { exclude_1d: true, .. }) && dims.len() <= 1;
    ParamRule {
        frozen: false,
        lr_scale: 1.0,
        weight_decay: if excluded { 0.0 } else { optim.weight_decay() },
        lars_adaptation: matches!(optim, OptimConfig::Lars { .. }) && !excluded,
    }
}

/// Whether `name` is in a frozen group of `groups` (before the groups are checked: the model
/// is being built).
pub fn is_frozen(groups: &ParamGroupsConfig, name: &str) -> bool {
    groups.groups.iter().any(|g| g.frozen && g.params.iter().any(|p| name_matches(p, name)))
}

/// Every parameter's rule (`params`: names and shapes, in name order). Errors name the
/// pattern that matches no parameter, or the parameter that two groups claim.
pub fn resolve(
    optim: &OptimConfig,
    groups: &ParamGroupsConfig,
    params: &[(String, Vec<usize>)],
) -> Result<BTreeMap<String, ParamRule>, String> {
    for (i, g) in groups.groups.iter().enumerate() {
        for p in &g.params {
            if !params.iter().any(|(n, _)| name_matches(p, n)) {
                let some: Vec<&str> = params.iter().take(8).map(|(n, _)| n.as_str()).collect();
                return Err(format!(
                    "param_groups.groups[{i}].params: pattern `{p}` matches no parameter of the model (its {} \
                     parameters begin {}{}); `*` stands for any characters, `?` for one",
                    params.len(),
                    some.join(", "),
                    if params.len() > some.len() { ", ..." } else { "" }
                ));
            }
        }
    }
    let lars = matches!(optim, OptimConfig::Lars { .. });
    let lars_excludes = !matches!(optim, OptimConfig::Lars { exclude_1d: false, .. });
    let mut out = BTreeMap::new();
    for (name, dims) in params {
        let mut owner: Option<(usize, &str)> = None;
        for (i, g) in groups.groups.iter().enumerate() {
            let Some(p) = g.params.iter().find(|p| name_matches(p, name)) else { continue };
            if let Some((j, q)) = owner {
                return Err(format!(
                    "parameter {name} is in two groups: param_groups.groups[{j}] (pattern `{q}`) and \
                     param_groups.groups[{i}] (pattern `{p}`); a parameter may be in one group only"
                ));
            }
            owner = Some((i, p));
        }
        let excluded = groups.exclude_1d && lars_excludes && dims.len() <= 1;
        let default = ParamRule {
            frozen: false,
            lr_scale: 1.0,
            weight_decay: if excluded { 0.0 } else { optim.weight_decay() },
            lars_adaptation: lars && !excluded,
        };
        let rule = match owner.map(|(i, _)| &groups.groups[i]) {
            None => default,
            Some(g) if g.frozen => ParamRule { frozen: true, lr_scale: 0.0, weight_decay: 0.0, lars_adaptation: false },
            Some(g) => ParamRule {
                frozen: false,
                lr_scale: g.lr_scale,
                weight_decay: g.weight_decay.unwrap_or(default.weight_decay),
                lars_adaptation: lars && g.lars_adaptation.unwrap_or(default.lars_adaptation),
            },
        };
        out.insert(name.clone(), rule);
    }
    if !out.is_empty() && out.values().all(|r| r.frozen) {
        return Err("param_groups: every parameter is in a frozen group: nothing would train".into());
    }
    Ok(out)
}

/// Checks that a checkpoint's rules (`saved`; `None`: a checkpoint written before the rules
/// were recorded, trained with [`legacy`]'s) are this run's (`now`); the error names the first
/// parameter whose rule differs and both rules.
pub fn check_resume(
    saved: Option<&BTreeMap<String, ParamRule>>,
    now: &BTreeMap<String, ParamRule>,
    optim: &OptimConfig,
    shapes: &BTreeMap<String, Vec<usize>>,
) -> Result<(), String> {
    for (name, rule) in now {
        let then = match saved {
            Some(s) => s.get(name).cloned(),
            None => shapes.get(name).map(|d| legacy(optim, d)),
        };
        let Some(then) = then else { continue };
        if then != *rule {
            let hint = match saved {
                None => {
                    " (the checkpoint was written before parameter groups existed, when every parameter took \
                     the optimizer's weight decay: resume it with param_groups.exclude_1d: false and no groups)"
                }
                Some(_) => " (resume with the param_groups the checkpoint was written with)",
            };
            return Err(format!(
                "parameter {name} was trained with {} there, this config gives {}{hint}",
                then.describe(),
                rule.describe()
            ));
        }
    }
    if let Some(saved) = saved {
        if let Some(name) = saved.keys().find(|n| !now.contains_key(*n)) {
            return Err(format!("it has a rule for parameter {name}, which this model does not have: was the model changed?"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GroupConfig;

    fn group(params: &[&str]) -> GroupConfig {
        GroupConfig {
            params: params.iter().map(|s| s.to_string()).collect(),
            lr_scale: 1.0,
            weight_decay: None,
            lars_adaptation: None,
            frozen: false,
        }
    }

    fn clip_like() -> Vec<(String, Vec<usize>)> {
        [
            ("logit_scale", vec![]),
            ("text_model.embeddings.token_embedding.weight", vec![10, 4]),
            ("text_model.final_layer_norm.bias", vec![4]),
            ("text_model.final_layer_norm.weight", vec![4]),
            ("vision_model.embeddings.class_embedding", vec![4]),
            ("vision_model.encoder.layers.0.mlp.fc1.bias", vec![8]),
            ("vision_model.encoder.layers.0.mlp.fc1.weight", vec![8, 4]),
        ]
        .into_iter()
        .map(|(n, d)| (n.to_string(), d))
        .collect()
    }

    const ADAMW: OptimConfig = OptimConfig::Adamw { lr: 1e-3, beta1: 0.9, beta2: 0.98, eps: 1e-6, weight_decay: 0.2 };

    #[test]
    fn by_default_only_parameters_of_two_or_more_dimensions_take_weight_decay() {
        let rules = resolve(&ADAMW, &ParamGroupsConfig::default(), &clip_like()).unwrap();
        for (name, dims) in clip_like() {
            let r = &rules[&name];
            assert_eq!(r.weight_decay, if dims.len() >= 2 { 0.2 } else { 0.0 }, "{name}");
            assert_eq!((r.lr_scale, r.frozen, r.lars_adaptation), (1.0, false, false), "{name}");
        }
        // exclude_1d: false is the rule of every parameter as written (the old behaviour).
        let all = ParamGroupsConfig { exclude_1d: false, groups: vec![] };
        let rules = resolve(&ADAMW, &all, &clip_like()).unwrap();
        for (name, dims) in clip_like() {
            assert_eq!(rules[&name], legacy(&ADAMW, &dims), "{name}");
            assert_eq!(rules[&name].weight_decay, 0.2, "{name}");
        }
    }

    #[test]
    fn lars_excludes_1d_parameters_from_adaptation_unless_either_switch_is_off() {
        let lars =
            |exclude_1d| OptimConfig::Lars { lr: 0.1, momentum: 0.9, weight_decay: 1e-6, trust_coefficient: 1e-3, exclude_1d };
        for (opt_ex, groups_ex) in [(true, true), (true, false), (false, true), (false, false)] {
            let g = ParamGroupsConfig { exclude_1d: groups_ex, groups: vec![] };
            let rules = resolve(&lars(opt_ex), &g, &clip_like()).unwrap();
            let excluded = opt_ex && groups_ex;
            let b = &rules["text_model.final_layer_norm.bias"];
            assert_eq!((b.lars_adaptation, b.weight_decay), (!excluded, if excluded { 0.0 } else { 1e-6 }));
            let w = &rules["vision_model.encoder.layers.0.mlp.fc1.weight"];
            assert_eq!((w.lars_adaptation, w.weight_decay), (true, 1e-6));
            // The defaults (both true) give what LARS alone gave before.
            if opt_ex && groups_ex {
                for (name, dims) in clip_like() {
                    assert_eq!(rules[&name], legacy(&lars(true), &dims), "{name}");
                }
            }
        }
    }

    #[test]
    fn groups_set_their_own_rule_and_frozen_groups_freeze() {
        let groups = ParamGroupsConfig {
            exclude_1d: true,
            groups: vec![
                GroupConfig { frozen: true, ..group(&["text_model.*"]) },
                GroupConfig { lr_scale: 10.0, ..group(&["logit_scale"]) },
                GroupConfig { weight_decay: Some(0.05), lr_scale: 0.5, ..group(&["vision_model.encoder.*"]) },
            ],
        };
        let rules = resolve(&ADAMW, &groups, &clip_like()).unwrap();
        let r = |n: &str| rules[n].clone();
        assert!(r("text_model.final_layer_norm.bias").frozen && r("text_model.embeddings.token_embedding.weight").frozen);
        assert_eq!(r("text_model.final_layer_norm.bias").lr_scale, 0.0);
        assert_eq!((r("logit_scale").lr_scale, r("logit_scale").weight_decay), (10.0, 0.0));
        // An explicit weight decay applies to the group's 1-D parameters too.
        assert_eq!(r("vision_model.encoder.layers.0.mlp.fc1.bias").weight_decay, 0.05);
        assert_eq!(r("vision_model.encoder.layers.0.mlp.fc1.weight").lr_scale, 0.5);
        // Outside every group: the default rule.
        assert_eq!(r("vision_model.embeddings.class_embedding").weight_decay, 0.0);
        assert!(is_frozen(&groups, "text_model.x") && !is_frozen(&groups, "logit_scale"));
    }

    #[test]
    fn a_pattern_that_matches_nothing_or_a_parameter_in_two_groups_is_an_error_naming_it() {
        let g = ParamGroupsConfig { exclude_1d: true, groups: vec![group(&["logit_scale"]), group(&["visual.*"])] };
        let e = resolve(&ADAMW, &g, &clip_like()).unwrap_err();
        assert!(e.contains("param_groups.groups[1].params: pattern `visual.*` matches no parameter"), "{e}");
        assert!(e.contains("logit_scale, text_model"), "the parameters are listed: {e}");
        let g = ParamGroupsConfig { exclude_1d: true, groups: vec![group(&["*.bias"]), group(&["vision_model.*"])] };
        let e = resolve(&ADAMW, &g, &clip_like()).unwrap_err();
        assert!(
            e.contains("parameter vision_model.encoder.layers.0.mlp.fc1.bias is in two groups")
                && e.contains("param_groups.groups[0] (pattern `*.bias`)")
                && e.contains("param_groups.groups[1] (pattern `vision_model.*`)"),
            "{e}"
        );
        let g = ParamGroupsConfig { exclude_1d: true, groups: vec![GroupConfig { frozen: true, ..group(&["*"]) }] };
        let e = resolve(&ADAMW, &g, &clip_like()).unwrap_err();
        assert!(e.contains("every parameter is in a frozen group"), "{e}");
    }

    #[test]
    fn resuming_with_other_rules_is_an_error_naming_the_parameter() {
        let shapes: BTreeMap<String, Vec<usize>> = clip_like().into_iter().collect();
        let now = resolve(&ADAMW, &ParamGroupsConfig::default(), &clip_like()).unwrap();
        check_resume(Some(&now), &now, &ADAMW, &shapes).unwrap();
        let g = ParamGroupsConfig { exclude_1d: true, groups: vec![GroupConfig { lr_scale: 2.0, ..group(&["logit_scale"]) }] };
        let other = resolve(&ADAMW, &g, &clip_like()).unwrap();
        let e = check_resume(Some(&now), &other, &ADAMW, &shapes).unwrap_err();
        assert!(e.contains("parameter logit_scale was trained with lr_scale 1, weight_decay 0 there"), "{e}");
        assert!(e.contains("this config gives lr_scale 2, weight_decay 0"), "{e}");
        // A checkpoint without rules was trained with every parameter decayed.
        let e = check_resume(None, &now, &ADAMW, &shapes).unwrap_err();
        assert!(e.contains("param_groups.exclude_1d: false"), "{e}");
        let old = resolve(&ADAMW, &ParamGroupsConfig { exclude_1d: false, groups: vec![] }, &clip_like()).unwrap();
        check_resume(None, &old, &ADAMW, &shapes).unwrap();
    }
}
