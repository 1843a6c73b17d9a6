import java.net.URLDecoder;
import java.net.URLEncoder;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.time.LocalDateTime;
import java.time.ZoneOffset;
import java.time.format.DateTimeFormatter;
import java.util.Base64;
import java.util.HashMap;
import java.util.HexFormat;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.StringJoiner;
import java.util.TreeMap;
import javax.crypto.Mac;
import javax.crypto.spec.SecretKeySpec;
import javax.security.auth.callback.Callback;
import javax.security.auth.callback.UnsupportedCallbackException;
import javax.security.auth.login.AppConfigurationEntry;
import org.apache.kafka.common.security.auth.AuthenticateCallbackHandler;
import org.apache.kafka.common.security.oauthbearer.OAuthBearerToken;
import org.apache.kafka.common.security.oauthbearer.OAuthBearerValidatorCallback;

/**
 * A broker's OAUTHBEARER validator (sasl.server.callback.handler.class) that takes tokens
 * as Amazon MSK's IAM listener does: a base64url presigned GET of
 * https://kafka.REGION.amazonaws.com/?Action=kafka-cluster:Connect, SigV4-signed for the
 * kafka-cluster service, checked here against the secret of the access key it names. For
 * the tests only; its settings are system properties (the broker's login module takes
 * no options it does not know): gatehouse.msk.keys=ACCESS_KEY=SECRET,...,
 * gatehouse.msk.region=REGION. The
 * principal is the access key; the token lasts until the presigned URL expires. Written
 * from AWS's SigV4 description, not from a signer.
 */
public class MskIamValidator implements AuthenticateCallbackHandler {
    private static final String SERVICE = "kafka-cluster";
    private final Map<String, String> secrets = new HashMap<>();
    private String region;

    @Override
    public void configure(Map<String, ?> configs, String mechanism,
                          List<AppConfigurationEntry> entries) {
        for (String pair : System.getProperty("gatehouse.msk.keys").split(",")) {
            int eq = pair.indexOf('=');
            secrets.put(pair.substring(0, eq), pair.substring(eq + 1));
        }
        region = System.getProperty("gatehouse.msk.region");
    }

    @Override
    public void handle(Callback[] callbacks) throws UnsupportedCallbackException {
        for (Callback callback : callbacks) {
            if (!(callback instanceof OAuthBearerValidatorCallback)) {
                throw new UnsupportedCallbackException(callback);
            }
            OAuthBearerValidatorCallback validation = (OAuthBearerValidatorCallback) callback;
            try {
                validation.token(verify(validation.tokenValue()));
            } catch (Exception e) {
                System.out.println("MskIamValidator refused a token: " + e.getMessage());
                validation.error("invalid_token", null, null);
            }
        }
    }

    @Override
    public void close() {
    }

    private OAuthBearerToken verify(String token) throws Exception {
        String url = new String(Base64.getUrlDecoder().decode(token), StandardCharsets.UTF_8);
        String host = "kafka." + region + ".amazonaws.com";
        int q = url.indexOf('?');
        if (q < 0 || !url.substring(0, q).equals("https://" + host + "/")) {
            throw new Exception("not a URL of " + host);
        }
        Map<String, String> params = new HashMap<>();
        TreeMap<String, String> signed = new TreeMap<>();
        for (String pair : url.substring(q + 1).split("&")) {
            int eq = pair.indexOf('=');
            String key = URLDecoder.decode(pair.substring(0, eq), StandardCharsets.UTF_8);
            String value = URLDecoder.decode(pair.substring(eq + 1), StandardCharsets.UTF_8);
            params.put(key, value);
            if (!key.equals("X-Amz-Signature") && !key.equals("User-Agent")) {
                signed.put(encode(key), encode(value));
            }
        }
        if (!"kafka-cluster:Connect".equals(params.get("Action"))) {
            throw new Exception("not a kafka-cluster:Connect");
        }
        if (!"AWS4-HMAC-SHA256".equals(params.get("X-Amz-Algorithm"))
                || !"host".equals(params.get("X-Amz-SignedHeaders"))) {
            throw new Exception("not AWS4-HMAC-SHA256 over the host");
        }
        String[] credential = params.get("X-Amz-Credential").split("/");
        if (credential.length != 5 || !credential[2].equals(region)
                || !credential[3].equals(SERVICE) || !credential[4].equals("aws4_request")) {
            throw new Exception("a credential scope for another region or service");
        }
        String secret = secrets.get(credential[0]);
        if (secret == null) {
            throw new Exception("an unknown access key " + credential[0]);
        }
        StringJoiner query = new StringJoiner("&");
        signed.forEach((k, v) -> query.add(k + "=" + v));
        String canonical = String.join("\n", "GET", "/", query.toString(), "host:" + host, "",
                                       "host", hex(sha256("")));
        String amzDate = params.get("X-Amz-Date");
        String scope = credential[1] + "/" + region + "/" + SERVICE + "/aws4_request";
        String toSign = String.join("\n", "AWS4-HMAC-SHA256", amzDate, scope,
                                    hex(sha256(canonical)));
        byte[] key = hmac(("AWS4" + secret).getBytes(StandardCharsets.UTF_8), credential[1]);
        for (String part : new String[] {region, SERVICE, "aws4_request"}) {
            key = hmac(key, part);
        }
        byte[] expected = hex(hmac(key, toSign)).getBytes(StandardCharsets.UTF_8);
        byte[] given = params.getOrDefault("X-Amz-Signature", "").getBytes(StandardCharsets.UTF_8);
        if (!MessageDigest.isEqual(expected, given)) {
            throw new Exception("the signature does not match");
        }
        long signedAt = LocalDateTime.parse(amzDate, DateTimeFormatter.ofPattern("yyyyMMdd'T'HHmmss'Z'"))
                .toInstant(ZoneOffset.UTC).toEpochMilli();
        long expires = signedAt + 1000L * Long.parseLong(params.get("X-Amz-Expires"));
        long now = System.currentTimeMillis();
        if (now >= expires || signedAt > now + 300_000) {
            throw new Exception("expired or signed in the future");
        }
        String principal = credential[0];
        return new OAuthBearerToken() {
            public String value() { return token; }
            public Set<String> scope() { return Set.of("kafka-cluster:Connect"); }
            public long lifetimeMs() { return expires; }
            public String principalName() { return principal; }
            public Long startTimeMs() { return signedAt; }
        };
    }

    private static String encode(String text) {
        return URLEncoder.encode(text, StandardCharsets.UTF_8)
                .replace("+", "%20").replace("*", "%2A").replace("%7E", "~");
    }

    private static byte[] sha256(String text) throws Exception {
        return MessageDigest.getInstance("SHA-256").digest(text.getBytes(StandardCharsets.UTF_8));
    }

    private static byte[] hmac(byte[] key, String text) throws Exception {
        Mac mac = Mac.getInstance("HmacSHA256");
        mac.init(new SecretKeySpec(key, "HmacSHA256"));
        return mac.doFinal(text.getBytes(StandardCharsets.UTF_8));
    }

    private static String hex(byte[] bytes) {
        return HexFormat.of().formatHex(bytes);
    }
}
