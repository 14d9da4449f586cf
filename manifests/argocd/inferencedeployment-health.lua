-- Argo CD health of a kvscale.dev InferenceDeployment, from the status the operator writes
-- (docs/operator.md, "GitOps"): key resource.customizations.health.kvscale.dev_InferenceDeployment
-- of argocd-cm (argocd-cm.yaml beside this file carries it). Lua 5.1, as Argo CD runs it.
--   Degraded:    the Degraded condition of this generation is True (a spec refused or failing to
--                apply, a model download failing, a rollout past its deadline), or a worker
--                refused one of spec.adapters;
--   Progressing: the operator has not applied this generation yet, or workers are starting or
--                rolling out (Ready False);
--   Healthy:     Ready True: every wanted worker serves the current spec (also at zero workers,
--                where the router wakes one on the first request).
local hs = { status = "Progressing", message = "waiting for the kvscale operator" }
if obj.status == nil then
  return hs
end
local generation = obj.metadata.generation or 0
local conditions = {}
if obj.status.conditions ~= nil then
  for _, c in ipairs(obj.status.conditions) do
    conditions[c.type] = c
  end
end
local degraded = conditions["Degraded"]
-- A refused spec is never applied (observedGeneration stays behind), but its Degraded condition
-- says so for this generation: checked first.
if degraded ~= nil and degraded.status == "True" and (degraded.observedGeneration or generation) >= generation then
  hs.status = "Degraded"
  hs.message = (degraded.reason or "Degraded") .. ": " .. (degraded.message or "")
  return hs
end
if obj.status.adapters ~= nil then
  for _, a in ipairs(obj.status.adapters) do
    if a.state == "Failed" then
      hs.status = "Degraded"
      hs.message = "adapter " .. a.name .. " failed: " .. (a.message or "")
      return hs
    end
  end
end
if (obj.status.observedGeneration or 0) < generation then
  hs.message = "the operator has not applied generation " .. generation .. " yet"
  return hs
end
local ready = conditions["Ready"]
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or ""
  return hs
end
if ready ~= nil then
  hs.message = (ready.reason or "NotReady") .. ": " .. (ready.message or "")
end
return hs
