import java.nio.file.Files;
import java.nio.file.Path;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import javax.security.auth.login.AppConfigurationEntry;
import org.apache.kafka.common.security.oauthbearer.BrokerJwtValidator;
import org.apache.kafka.common.security.oauthbearer.OAuthBearerToken;

/**
 * What a Kafka broker's own OAUTHBEARER validator (BrokerJwtValidator, the one behind
 * sasl.oauthbearer.jwks.endpoint.url) says of each token in a file: "OK principal" or
 * "REFUSED", a line each.  The proxy's checks are held to it.
 *
 * Arguments: JWKS URL (file:...), expected issuer, expected audiences (comma-separated),
 * clock skew seconds, principal claim name, tokens file (one per line).
 */
public class KafkaJwtOracle {
    public static void main(String[] args) throws Exception {
        Map<String, Object> configs = new HashMap<>();
        configs.put("sasl.oauthbearer.jwks.endpoint.url", args[0]);
        configs.put("sasl.oauthbearer.expected.issuer", args[1]);
        configs.put("sasl.oauthbearer.expected.audience", List.of(args[2].split(",")));
        configs.put("sasl.oauthbearer.clock.skew.seconds", Integer.parseInt(args[3]));
        configs.put("sasl.oauthbearer.sub.claim.name", args[4]);
        configs.put("sasl.oauthbearer.scope.claim.name", "scope");
        configs.put("sasl.oauthbearer.jwks.endpoint.refresh.ms", 3600000L);
        configs.put("sasl.oauthbearer.jwks.endpoint.retry.backoff.ms", 100L);
        configs.put("sasl.oauthbearer.jwks.endpoint.retry.backoff.max.ms", 10000L);
        BrokerJwtValidator validator = new BrokerJwtValidator();
        validator.configure(configs, "OAUTHBEARER", List.of(new AppConfigurationEntry(
            "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule",
            AppConfigurationEntry.LoginModuleControlFlag.REQUIRED, Map.of())));
        for (String token : Files.readAllLines(Path.of(args[5]))) {
            try {
                OAuthBearerToken verified = validator.validate(token);
                System.out.println("OK " + verified.principalName());
            } catch (Exception e) {
                // Kafka's messages quote the token: only the verdict is printed.
                System.out.println("REFUSED");
            }
        }
    }
}
